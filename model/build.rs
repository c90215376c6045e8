//! Link flags for this crate's own binaries and tests (see link_torch.rs), and the libtorch lib
//! dir re-exported to dependents as `DEP_DIFFMESH_TORCH_LIB` for their build scripts.
include!("link_torch.rs");

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-changed=link_torch.rs");
    // torch-sys (`links = "tch"`) exports its libtorch lib dir to direct dependents.
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    link_torch(std::path::Path::new(&lib));
    println!("cargo:lib={lib}");
}

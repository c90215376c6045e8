//! Link flags for binaries and tests that use libtorch through diffmesh-model.
include!("../model/link_torch.rs");

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_DIFFMESH_TORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_DIFFMESH_TORCH_LIB") {
        link_torch(std::path::Path::new(&lib));
    }
}

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
    compile_cpu_autocast(std::path::Path::new(&lib));
}

/// The CPU autocast shim (cpp/cpu_autocast.cpp) against the headers next to libtorch's lib dir.
fn compile_cpu_autocast(lib: &std::path::Path) {
    println!("cargo:rerun-if-changed=cpp/cpu_autocast.cpp");
    let include = lib.parent().map(|p| p.join("include")).unwrap_or_default();
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        // PyPI's torch >= 2.7 is built with the C++11 ABI (the shim passes no std types anyway).
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .file("cpp/cpu_autocast.cpp")
        .compile("diffmesh_cpu_autocast");
}

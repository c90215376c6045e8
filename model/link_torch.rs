// Shared by the build scripts of every crate whose binaries or tests link libtorch
// (`include!`d from their build.rs), so the rule lives in one place.
//
// Rust links with `--as-needed`; nothing references a symbol of `libtorch_cuda` directly, so the
// linker would drop it and CUDA would stay invisible at run time: force it in where it exists.
// Also give the binaries an rpath to libtorch so they run without LD_LIBRARY_PATH.
// `lib` is the libtorch lib dir (from torch-sys's or diffmesh-model's `links` metadata).
fn link_torch(lib: &std::path::Path) {
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-L{}", lib.display());
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

//! Prints what libtorch sees: proves `libtorch_cuda` was linked (CUDA devices visible on a GPU
//! machine) and shows the CPU thread settings benchmarks run with.
fn main() {
    println!("cuda available: {}", tch::Cuda::is_available());
    println!("cuda devices: {}", tch::Cuda::device_count());
    println!("cudnn available: {}", tch::Cuda::cudnn_is_available());
    println!("intra-op threads: {}", tch::get_num_threads());
}

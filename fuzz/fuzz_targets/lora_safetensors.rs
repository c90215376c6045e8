//! A LoRA upload's `.safetensors` bytes: the gateway's check (`loras::form::check`, i.e.
//! `LoraFile::parse` of the header and metadata). A file it accepts must be one the denoiser can
//! read: every module's tensors present, with the shapes and a finite scale the header gave.
#![no_main]

use diffmesh_gateway::loras::form::check;
use libfuzzer_sys::fuzz_target;
use safetensors::SafeTensors;

#[global_allocator]
static ALLOC: diffmesh_fuzz::CappedAlloc = diffmesh_fuzz::CappedAlloc;

fuzz_target!(
    init: diffmesh_fuzz::write_seeds_if_asked(diffmesh_fuzz::seeds::loras),
    |data: &[u8]| {
        let upload = match check(data.to_vec(), Some("name".into())) {
            Ok(upload) => upload,
            Err(e) => {
                assert_eq!(e.field, "weights", "{e:?}");
                return;
            }
        };
        // What the denoiser's `LoraBlob::adapter` does before it builds tensors.
        let st = SafeTensors::deserialize(data).expect("an accepted file deserializes");
        for m in &upload.file.modules {
            let down = st.tensor(&m.down_key).expect("lora_A is there");
            let up = st.tensor(&m.up_key).expect("lora_B is there");
            assert_eq!(down.shape(), [m.rank, m.in_features]);
            assert_eq!(up.shape(), [m.out_features, m.rank]);
            assert_eq!(down.dtype(), up.dtype());
            assert!(m.scale.is_finite());
        }
    }
);

//! A LoRA upload's `.safetensors` bytes: the gateway's check (`loras::form::check`, i.e.
//! `LoraFile::parse_header` of the header and metadata, as a spooled upload is checked). A file it accepts must be one the denoiser can
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
        let mut read_at = |offset: u64, len: usize| {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            data.get(start..start.saturating_add(len))
                .map(<[u8]>::to_vec)
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))
        };
        let (file, _) = match check(data, data.len() as u64, &mut read_at, Some("name".into())) {
            Ok(checked) => checked,
            Err(e) => {
                assert_eq!(e.field, "weights", "{e:?}");
                return;
            }
        };
        // What the denoiser's `LoraBlob::adapter` does before it builds tensors.
        let st = SafeTensors::deserialize(data).expect("an accepted file deserializes");
        for m in &file.modules {
            let down = st.tensor(&m.down_key).expect("lora_A is there");
            let up = st.tensor(&m.up_key).expect("lora_B is there");
            assert_eq!(down.shape(), [m.rank, m.in_features]);
            assert_eq!(up.shape(), [m.out_features, m.rank]);
            assert_eq!(down.dtype(), up.dtype());
            assert!(m.scale.is_finite());
        }
    }
);

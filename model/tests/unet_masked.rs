//! The mask-aware UNet (FlashPS for UNets) on a random SDXL-shaped UNet (fp32 CPU): with every
//! token masked it is the full forward; with the template's own inputs and a partial mask it is
//! the full forward too (the cache holds exactly what it replaces), at a side that does not
//! divide by the downsampling; an edit reads the cache (another template's cache changes the
//! result); rows sharing a mask (a guided step) equal each row alone, and so do rows of one
//! batch with different masks (one of them masking every token); a guided template's rows are
//! each read by their own edit row, and rows of two templates mix in one batch; bad masks and
//! caches are refused naming the field. A cache through the tiers' block codec reads the same
//! (exactly in f32).
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use diffmesh_model::unet::{UNet2DConditionModel, UNetConfig, UNetInputs};
use std::sync::Mutex;

/// Torch's RNG is global: one test draws at a time.
static TURN: Mutex<()> = Mutex::new(());

fn unet() -> (UNet2DConditionModel, nn::VarStore) {
    let config: UNetConfig = serde_json::from_value(serde_json::json!({
        "block_out_channels": [32, 64, 64],
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "attention_head_dim": [2, 4, 4],
        "transformer_layers_per_block": [1, 2, 1],
        "cross_attention_dim": 24,
        "layers_per_block": 1,
        "norm_num_groups": 16,
        "use_linear_projection": true,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 12 + 6 * 8,
    }))
    .unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = UNet2DConditionModel::new(&vs.root(), config).unwrap();
    (model, vs)
}

fn inputs(batch: i64, h: i64, w: i64) -> UNetInputs {
    let opts = (Kind::Float, Device::Cpu);
    UNetInputs {
        sample: Tensor::randn([batch, 4, h, w], opts),
        timestep: Tensor::from_slice(&[400.0f32]),
        encoder_hidden_states: Tensor::randn([batch, 5, 24], opts),
        text_embeds: Some(Tensor::randn([batch, 12], opts)),
        time_ids: Some(
            Tensor::from_slice(&[512.0f32, 512.0, 0.0, 0.0, 512.0, 512.0]).repeat([batch, 1]),
        ),
    }
}

/// `count` random latent pixels of an `h x w` map.
fn mask(h: i64, w: i64, count: i64) -> Tensor {
    let index = Tensor::randperm(h * w, (Kind::Int64, Device::Cpu)).narrow(0, 0, count);
    Tensor::zeros([h * w], (Kind::Float, Device::Cpu))
        .index_fill(0, &index, 1.0)
        .view([h, w])
}

/// Row `row` of a batch's inputs.
fn row_of(batch: &UNetInputs, row: i64) -> UNetInputs {
    UNetInputs {
        sample: batch.sample.narrow(0, row, 1),
        timestep: batch.timestep.shallow_clone(),
        encoder_hidden_states: batch.encoder_hidden_states.narrow(0, row, 1),
        text_embeds: batch.text_embeds.as_ref().map(|t| t.narrow(0, row, 1)),
        time_ids: batch.time_ids.as_ref().map(|t| t.narrow(0, row, 1)),
    }
}

fn max_err(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn mask_aware_unet_equals_full_compute_where_it_must() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(3);
    let (unet, _vs) = unet();
    let (h, w) = (13, 10);
    let x = inputs(1, h, w);
    tch::no_grad(|| {
        let full = unet.forward(&x).unwrap();
        let (captured_out, cache) = unet.forward_capture(&x).unwrap();
        assert_eq!(
            max_err(&captured_out, &full),
            0.0,
            "capturing changes nothing"
        );
        assert!(cache.bytes() > 0);

        // Every token masked: the full forward, whatever the cache holds.
        let other = inputs(1, h, w);
        let (_, other_cache) = unet.forward_capture(&other).unwrap();
        let all = unet
            .forward_masked(
                &x,
                &Tensor::ones([h, w], (Kind::Float, Device::Cpu)),
                &other_cache,
            )
            .unwrap();
        let err = max_err(&all, &full);
        println!("mask 1.0: max abs err {err:.2e}");
        assert!(err <= 1e-5, "mask 1.0: {err}");

        // The template's own inputs: the cache holds exactly what it replaces.
        for count in [1, 26, 65] {
            let m = mask(h, w, count);
            let got = unet.forward_masked(&x, &m, &cache).unwrap();
            let err = max_err(&got, &full);
            println!(
                "{count} of {} latent pixels masked, own cache: max abs err {err:.2e}",
                h * w
            );
            assert!(err <= 1e-4, "{count}: {err}");
            // Another template's cache changes the result: the cache is read.
            let moved = max_err(&unet.forward_masked(&x, &m, &other_cache).unwrap(), &full);
            assert!(
                moved > 1e-3,
                "{count}: another cache moved the output by only {moved}"
            );
        }
    });
}

#[test]
fn rows_sharing_a_mask_equal_each_row_alone() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(5);
    let (unet, _vs) = unet();
    let (h, w) = (8, 8);
    let template = inputs(1, h, w);
    let batch = inputs(2, h, w);
    let m = mask(h, w, 13);
    tch::no_grad(|| {
        let (_, cache) = unet.forward_capture(&template).unwrap();
        let both = unet.forward_masked(&batch, &m, &cache).unwrap();
        for row in 0..2 {
            let alone = unet
                .forward_masked(&row_of(&batch, row), &m, &cache)
                .unwrap();
            let err = max_err(&both.narrow(0, row, 1), &alone);
            assert!(err <= 1e-5, "row {row}: {err}");
        }
        // Refusals.
        let err = unet
            .forward_masked(
                &template,
                &Tensor::ones([4, 4], (Kind::Float, Device::Cpu)),
                &cache,
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("mask"), "{err}");
        let err = unet
            .forward_masked(
                &template,
                &Tensor::zeros([h, w], (Kind::Float, Device::Cpu)),
                &cache,
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("mask"), "{err}");
        let (_, small) = unet.forward_capture(&inputs(1, 4, 4)).unwrap();
        let err = unet
            .forward_masked(&template, &m, &small)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cache"), "{err}");
    });
}

#[test]
fn a_batch_of_different_masks_equals_each_mask_alone() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(7);
    let (unet, _vs) = unet();
    let (h, w) = (11, 9);
    let template = inputs(1, h, w);
    let batch = inputs(4, h, w);
    // A few pixels, a third, every pixel, and one pixel: each level's counts differ by row.
    let masks = [
        mask(h, w, 3),
        mask(h, w, 33),
        Tensor::ones([h, w], (Kind::Float, Device::Cpu)),
        mask(h, w, 1),
    ];
    let stacked = Tensor::stack(&masks, 0);
    tch::no_grad(|| {
        let (_, cache) = unet.forward_capture(&template).unwrap();
        let together = unet.forward_masked(&batch, &stacked, &cache).unwrap();
        for (row, m) in masks.iter().enumerate() {
            let row = row as i64;
            let alone = unet
                .forward_masked(&row_of(&batch, row), m, &cache)
                .unwrap();
            let err = max_err(&together.narrow(0, row, 1), &alone);
            println!("row {row} of a batch of 4 masks: max abs err {err:.2e}");
            // Batched matmuls sum in another order than one row's: 7.6e-6 seen at most.
            assert!(err <= 3e-5, "row {row}: {err}");
        }
        // The every-pixel row is the full forward of that row.
        let full = unet.forward(&row_of(&batch, 2)).unwrap();
        let err = max_err(&together.narrow(0, 2, 1), &full);
        assert!(err <= 1e-5, "the fully masked row: {err}");

        // One mask per row, but not as many as rows; a row that masks nothing.
        let err = unet
            .forward_masked(&batch, &stacked.narrow(0, 0, 3), &cache)
            .unwrap_err()
            .to_string();
        assert!(err.contains("mask"), "{err}");
        let none = stacked.copy();
        let _ = none.get(1).fill_(0.0);
        let err = unet
            .forward_masked(&batch, &none, &cache)
            .unwrap_err()
            .to_string();
        assert!(err.contains("mask") && err.contains("row 1"), "{err}");
    });
}

#[test]
fn rows_read_their_own_template_rows() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(11);
    let (unet, _vs) = unet();
    let (h, w) = (8, 10);
    // A guided template: two rows (negative and prompt) with different text.
    let template = inputs(2, h, w);
    let other = inputs(1, h, w);
    let m = mask(h, w, 21);
    tch::no_grad(|| {
        let full = unet.forward(&template).unwrap();
        let (_, cache) = unet.forward_capture(&template).unwrap();
        let (_, other_cache) = unet.forward_capture(&other).unwrap();
        assert_eq!((cache.rows(), other_cache.rows()), (2, 1));
        // The template's own two rows, each reading its own cache row: the full forward.
        let got = unet.forward_masked(&template, &m, &cache).unwrap();
        let err = max_err(&got, &full);
        println!("two template rows, row for row: max abs err {err:.2e}");
        assert!(err <= 1e-4, "{err}");
        // Swapped rows read the other row's keys and values: no longer the full forward.
        let swapped = unet
            .forward_masked_rows(&template, &m, &[(&cache, 1), (&cache, 0)])
            .unwrap();
        assert!(
            max_err(&swapped, &full) > 1e-3,
            "the cache rows were not read"
        );
        // Rows of two templates in one batch equal each alone.
        let mixed = unet
            .forward_masked_rows(&template, &m, &[(&cache, 0), (&other_cache, 0)])
            .unwrap();
        let second = unet
            .forward_masked(&row_of(&template, 1), &m, &other_cache)
            .unwrap();
        let err = max_err(&mixed.narrow(0, 0, 1), &full.narrow(0, 0, 1))
            .max(max_err(&mixed.narrow(0, 1, 1), &second));
        assert!(err <= 3e-5, "mixed templates: {err}");
        // A cache of 2 rows for a batch of 3, and a row the cache lacks.
        let err = unet
            .forward_masked(&inputs(3, h, w), &m, &cache)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cache"), "{err}");
        let err = unet
            .forward_masked_rows(&template, &m, &[(&cache, 0), (&other_cache, 1)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("cache") && err.contains("row 1"), "{err}");
    });
}

#[test]
fn a_cache_through_the_tiers_codec_reads_the_same() {
    use diffmesh_model::flux::kv_codec::CacheDtype;
    use diffmesh_model::unet::cache_codec::{decode_step, encode_step};
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(13);
    let (unet, _vs) = unet();
    let (h, w) = (8, 8);
    let template = inputs(2, h, w);
    let edit = inputs(2, h, w);
    let m = mask(h, w, 17);
    tch::no_grad(|| {
        let (_, cache) = unet.forward_capture(&template).unwrap();
        let layers = unet.transformer_layers();
        assert_eq!(layers.len(), cache.transformers.len());
        assert!(layers
            .iter()
            .zip(&cache.transformers)
            .all(|(l, t)| *l == t.kv.len()));
        let want = unet.forward_masked(&edit, &m, &cache).unwrap();
        for (dtype, tolerance) in [(CacheDtype::F32, 0.0), (CacheDtype::Bf16, 0.05)] {
            let blocks = encode_step(&cache, dtype).unwrap();
            let views: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
            let decoded = decode_step(&views, &layers, 2, Kind::Float).unwrap();
            let err = max_err(&unet.forward_masked(&edit, &m, &decoded).unwrap(), &want);
            println!("{dtype:?} cache through the codec: max abs err {err:.2e}");
            assert!(err <= tolerance, "{dtype:?}: {err}");
            if dtype == CacheDtype::F32 {
                assert_eq!(decoded.bytes(), cache.bytes());
            }
        }
        // Refused naming the cache: other layer counts, other rows, a cut block.
        let blocks = encode_step(&cache, CacheDtype::F32).unwrap();
        let views: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        let mut fewer = layers.clone();
        fewer[0] -= 1;
        let mut errors = vec![
            decode_step(&views, &fewer, 2, Kind::Float).unwrap_err(),
            decode_step(&views, &layers, 3, Kind::Float).unwrap_err(),
        ];
        let cut = &blocks[0][..blocks[0].len() - 1];
        let mut damaged = views.clone();
        damaged[0] = cut;
        errors.push(decode_step(&damaged, &layers, 2, Kind::Float).unwrap_err());
        for e in errors {
            let e = e.to_string();
            assert!(e.contains("cache") || e.contains("length"), "{e}");
        }
    });
}

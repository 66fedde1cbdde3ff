//! The native multimodal LLM against transformers' `LlavaForConditionalGeneration`.
//!
//! `workers/tests/fixtures/encoders/tiny-llava` is a random-weight LLaVA (CLIP tower, 3 layers; GELU
//! projector; Llama with GQA, 2 layers), written with the reference logits by
//! `make_reference.py` (transformers 5.24.0). Here the vision tower and projector run in
//! `switchyard-encoders` (as on an encoder worker), the features replace the image
//! placeholders' embeddings in `switchyard-llm` (as on an LLM worker), and every position's
//! logits must match transformers' within 1e-4, for images before, between and after text.

use switchyard_encoders::image::PixelValues;
use switchyard_encoders::tensor::Safetensors;
use switchyard_encoders::vit::VisionEncoder;
use switchyard_harness::fixtures;
use switchyard_llm::{ForwardError, MediaRows, Model};

const TOLERANCE: f32 = 1e-4;
const IMAGE_TOKEN: u32 = 300;
const TOKENS_PER_IMAGE: usize = 16;

#[test]
fn llava_logits_match_transformers_with_images_anywhere() {
    let _turn = switchyard_harness::turn();
    let refs = Safetensors::open(&fixtures::encoder("llava_logits.safetensors")).expect("reference");
    let encoder = VisionEncoder::load(&fixtures::encoder("tiny-llava")).expect("vision tower loads");
    let model = Model::load_language_model(&fixtures::encoder("tiny-llava")).expect("language model loads");
    let vocab = model.config().vocab_size;
    for (prompt, len, images) in [("prompt0", 21, 1), ("prompt1", 39, 2), ("prompt2", 20, 1)] {
        let ids: Vec<u32> = refs
            .f32(&format!("{prompt}/input_ids"), &[len])
            .expect("ids")
            .into_iter()
            .map(|id| id as u32)
            .collect();
        let pixels = refs
            .f32(&format!("{prompt}/pixel_values"), &[images, 3, 32, 32])
            .expect("pixels");
        let pixels: Vec<PixelValues> = pixels
            .as_chunks::<{ 3 * 32 * 32 }>()
            .0
            .iter()
            .map(|data| PixelValues {
                height: 32,
                width: 32,
                data: data.to_vec(),
            })
            .collect();
        let features = encoder.encode(&pixels.iter().collect::<Vec<_>>()).expect("encodes");
        // Each run of placeholders takes the next image's rows.
        let starts: Vec<usize> = (0..ids.len())
            .filter(|&i| ids[i] == IMAGE_TOKEN && (i == 0 || ids[i - 1] != IMAGE_TOKEN))
            .collect();
        assert_eq!(starts.len(), images);
        let media: Vec<MediaRows<'_>> = starts
            .iter()
            .enumerate()
            .map(|(k, &offset)| MediaRows {
                offset,
                rows: features.item(k),
            })
            .collect();
        assert!(media.iter().all(|m| m.rows.len() == TOKENS_PER_IMAGE * 48));
        let logits = model.forward_with_media(&ids, &media).expect("forward");
        let want = refs.f32(&format!("{prompt}/logits"), &[len, vocab]).expect("logits");
        let worst = logits.iter().zip(&want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        let spread = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        println!(
            "{prompt}: {len} tokens, {images} image(s) at {starts:?}, max |Δlogit| = {worst:e} (logits up to {spread})"
        );
        assert!(worst <= TOLERANCE, "{prompt}: max |Δlogit| {worst}");
        assert!(spread > 0.1, "degenerate reference");
        // Without the image rows the logits differ: the merge is what makes them match.
        let text_only = model.forward(&ids).expect("forward");
        let off = text_only
            .iter()
            .zip(&want)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            off > 100.0 * TOLERANCE,
            "{prompt}: placeholders alone already match ({off})"
        );
    }
}

#[test]
fn media_rows_that_do_not_fit_are_refused() {
    let _turn = switchyard_harness::turn();
    let model = Model::load_language_model(&fixtures::encoder("tiny-llava")).expect("loads");
    let rows = vec![0.5f32; 2 * 48];
    let err = model
        .forward_with_media(&[1, 300, 300], &[MediaRows { offset: 2, rows: &rows }])
        .expect_err("past the end");
    assert!(matches!(err, ForwardError::MediaOutOfRange { offset: 2, .. }), "{err}");
    let err = model
        .forward_with_media(
            &[1, 300, 300],
            &[MediaRows {
                offset: 1,
                rows: &rows[..50],
            }],
        )
        .expect_err("not whole rows");
    assert!(err.to_string().contains("do not fit"), "{err}");
    assert!(
        model
            .forward_with_media(&[1, 300, 300], &[MediaRows { offset: 1, rows: &rows }])
            .is_ok()
    );
}

//! Safetensors weight files as the native workers map them: the header (offsets checked
//! against the file), then every tensor widened to f32 with the shape the header gives. A
//! weight file is input from whoever published it: nothing may panic, and a tensor read is
//! either its values, one per element, or an error naming the tensor.

#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard_llm::weights::Weights;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("model.safetensors"), data).expect("write");
    let Ok(weights) = Weights::open(dir.path()) else {
        return;
    };
    let shapes: Vec<(String, Vec<usize>)> = weights
        .shapes()
        .map(|(name, shape)| (name.to_string(), shape.to_vec()))
        .collect();
    for (name, shape) in shapes {
        assert!(weights.contains(&name));
        if let Ok(values) = weights.f32(&name, &shape) {
            let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            assert_eq!(Some(values.len()), elements, "`{name}` {shape:?}");
        }
        let mut wrong = shape.clone();
        wrong.push(1);
        assert!(weights.f32(&name, &wrong).is_err(), "`{name}` read with another shape");
    }
});

//! GGUF model files as `switchyard-llm --model FILE.gguf` loads them: the header and its
//! metadata, the model configuration, the embedded tokenizer and chat template, then every
//! tensor the configuration implies, dequantized. A model file is input from whoever published
//! it: nothing may panic, and a bad file is an error that names it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard_llm::Model;
use switchyard_llm::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, data).expect("write");
    let Ok(file) = GgufFile::open(&path) else {
        return;
    };
    let _ = file.metadata("general.architecture");
    let _ = file.tokenizer();
    let _ = file.chat_template();
    if let Ok(config) = file.model_config() {
        // Loading reads every tensor the configuration names; keep the fuzzer's memory for
        // files whose tensors fit in what they could hold.
        let parameters = config
            .hidden_size
            .saturating_mul(config.vocab_size.max(config.intermediate_size));
        if parameters <= 1 << 22 {
            let _ = Model::load_with_tokenizer(&path);
        }
    }
});

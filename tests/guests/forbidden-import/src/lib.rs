//! Hostile guest `forbidden-import`: a std guest that prints and reads the environment, so its
//! component imports WASI interfaces outside the host world; the host must refuse it at load.

wit_bindgen::generate!({ path: "../../../wit", world: "switchyard:policy/router" });

struct Hostile;

impl Guest for Hostile {
    fn init() -> Result<Columns, PolicyError> {
        Ok(Columns::empty())
    }

    fn route(req: RequestInfo, _workers: WorkerTable) -> Result<Decision, PolicyError> {
        println!("request {} from {:?}", req.request_id, std::env::var("HOME"));
        Ok(Decision {
            worker: 0,
            encoders: Vec::new(),
            fallbacks: Vec::new(),
        })
    }
}

export!(Hostile);

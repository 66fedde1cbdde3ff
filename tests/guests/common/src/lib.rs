//! What every hostile guest shares: it passes the host's validation and misbehaves only on live
//! traffic. The host's self-test routes a 1024-token synthetic request; live traffic does not.

#![no_std]

pub use switchyard_policy_sdk as sdk;

/// Whether `req` is live traffic rather than the host's self-test.
pub fn live(req: &sdk::RequestInfo) -> bool {
    req.prompt_tokens != 1024
}

/// Exports a router that answers worker 0, except on live traffic, where it evaluates
/// `$misbehave` (an expression of type `Result<Decision, PolicyError>`, or one that never
/// returns) with the request bound to `$req`.
#[macro_export]
macro_rules! hostile_router {
    (|$req:ident| $misbehave:expr) => {
        struct Hostile;

        impl $crate::sdk::Router for Hostile {
            fn route(
                $req: &$crate::sdk::RequestInfo,
                _workers: &$crate::sdk::WorkerTable,
            ) -> Result<$crate::sdk::Decision, $crate::sdk::PolicyError> {
                if $crate::live($req) {
                    #[allow(unreachable_code)]
                    return $misbehave;
                }
                Ok($crate::sdk::Decision::to(0))
            }
        }

        $crate::sdk::router!(Hostile);
    };
}

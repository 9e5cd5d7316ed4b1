"""The HTTP engine core shared by every inference-server backend (SGLang: `canopy.rollout.sglang`, vLLM:
`canopy.rollout.vllm`): `client` (JSON over HTTP), `fleet` (launch, attach, health, control calls, relaunch, stop),
`routing` (per-episode sticky routing, retries, ejection and re-admission) and `engine` (`HTTPEngine`, the `Engine`
contract over a fleet). A backend supplies a `ServerBackend` (how its servers are launched, asked to generate,
and told their weight version) and a weight sync; everything else is written once here."""

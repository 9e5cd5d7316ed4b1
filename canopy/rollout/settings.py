"""`engine.*`: which engine generates (`name`, set by the engine group, conf/engine/<name>.yaml), the on-policy
audit's bounds by the engine's dtype, and each engine's own settings under `engine.<name>` (whichever is chosen, so
that `engine.name=vllm engine.vllm.urls=[...]` works): the schema, and with the engines' own dataclasses the only
defaults of those keys."""

from dataclasses import dataclass, field

from canopy.errors import is_int, require
from canopy.mismatch import GapBounds
from canopy.rollout.sglang.settings import SGLangSettings
from canopy.rollout.vllm.settings import VLLMSettings

ENGINES = ("local", "sglang", "vllm")


@dataclass
class LocalEngineSettings:
    """`engine.local.*`, the in-process engine's (`LocalEngine`): the schema and the only defaults of those keys. The
    embedded default runs it in float32 on the CPU."""

    dtype: str = "float32"  # float32 | bfloat16 | float16: the HF model's weights and compute
    device: str = "cpu"  # cpu | cuda | cuda:N (tokens are drawn on the CPU either way)
    session_tokens: int = 131072  # episode caches kept between turns, in tokens over all episodes (0: none, every
    # turn prefills its whole history; past the cap an episode's next turn does). A token holds
    # 2 x layers x kv_heads x head_dim x dtype bytes: 512 B on the tiny model (the embedded default's 128 episodes x
    # 1024 tokens fit), 160 KiB for Qwen3-14B in bf16

    def validate(self) -> None:
        require(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"engine.local.dtype={self.dtype!r} is unknown: use float32, bfloat16 or float16",
        )
        require(
            self.device in ("cpu", "cuda") or str(self.device).startswith("cuda:"),
            f"engine.local.device={self.device!r} is unknown: use cpu, cuda or cuda:N",
        )
        require(
            is_int(self.session_tokens) and self.session_tokens >= 0,
            f"engine.local.session_tokens={self.session_tokens!r} must be an integer >= 0 (0: no sessions kept)",
        )

    def compute_dtype(self, model_path: str) -> str:
        """The dtype the engine computes in: `dtype`."""
        return self.dtype


@dataclass
class EngineSettings:
    """`engine.*`: the schema. `name` and `gap_bounds` come from the engine group's file; `local`, `sglang` and
    `vllm` hold their engine's settings (read when that engine is chosen)."""

    name: str
    gap_bounds: dict[str, GapBounds]  # on mismatch/logprob_gap, by the engine's dtype (canopy.callbacks.OnPolicyAudit)
    local: LocalEngineSettings = field(default_factory=LocalEngineSettings)
    sglang: SGLangSettings = field(default_factory=SGLangSettings)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)

    def validate(self, accelerator: str, trainer_devices: int) -> None:
        """The chosen engine's settings (a server engine's against the trainer's accelerator and GPUs)."""
        require(self.name in ENGINES, f"engine.name={self.name!r} is unknown: use one of {', '.join(ENGINES)}")
        for dtype, bounds in self.gap_bounds.items():
            bounds.validate(f"engine.gap_bounds.{dtype}")
        if self.name == "local":
            self.local.validate()
        else:
            self.chosen.validate(accelerator, trainer_devices)

    @property
    def chosen(self) -> LocalEngineSettings | SGLangSettings | VLLMSettings:
        """The chosen engine's own settings, `engine.<name>`."""
        return getattr(self, self.name)

    def compute_dtype(self, model_path: str) -> str:
        """The dtype the chosen engine computes in, known before (and without) building it: SGLang's from its launch
        flags or the checkpoint at `model_path`."""
        return self.chosen.compute_dtype(model_path)

"""An episode's interaction budget (Sec. 3.1; Tables 2, A1 and A3): `Budget`, what the agent loop enforces, and
`BudgetSettings`, the `budget` config group that carries it with the engine's RoPE scaling (Appendix I)."""

from dataclasses import dataclass, fields
from typing import Any

from canopy.errors import require


@dataclass(frozen=True)
class Budget:
    """Interaction budget of one episode (Tables A1/A3; `per_turn_generation_cap=None` means uncapped)."""

    max_turns: int
    max_response_tokens: int
    max_prompt_tokens: int
    max_observation_tokens: int
    max_context_tokens: int
    per_turn_generation_cap: int | None = None

    @classmethod
    def of(cls, budget) -> "Budget":
        """From the `budget` config group (its other keys, such as its name, are not the episode's)."""
        return cls(**{key.name: getattr(budget, key.name) for key in fields(cls)})


@dataclass
class BudgetSettings:
    """A `budget` config group (conf/budget/*.yaml, each a whole budget of Table 2 / A3): the schema. The episode
    reads its `Budget`; `rope_scaling` is the engine's (the enlarged budget's YaRN)."""

    name: str
    max_turns: int
    max_response_tokens: int
    max_prompt_tokens: int
    max_observation_tokens: int
    max_context_tokens: int
    per_turn_generation_cap: int | None  # null: uncapped
    rope_scaling: dict[str, Any] | None

    def validate(self, key: str = "budget") -> None:
        for name in ("max_turns", "max_response_tokens", "max_prompt_tokens", "max_observation_tokens"):
            require(getattr(self, name) >= 1, f"{key}.{name}={getattr(self, name)} must be a positive integer")
        require(
            self.per_turn_generation_cap is None or self.per_turn_generation_cap >= 1,
            f"{key}.per_turn_generation_cap={self.per_turn_generation_cap} must be null (uncapped) or a positive "
            "integer",
        )
        require(
            self.max_prompt_tokens < self.max_context_tokens,
            f"{key}.max_prompt_tokens={self.max_prompt_tokens} must be below "
            f"{key}.max_context_tokens={self.max_context_tokens}",
        )

    def check_context(self, native: int, key: str = "budget") -> None:
        """The context fits the model's `native` positions, or the budget's RoPE scaling (YaRN) stretches that
        model's positions to cover it: a budget past what the model was built for is refused, never run."""
        context, scaling = self.max_context_tokens, self.rope_scaling
        group = "budget" if key == "budget" else f"budget@{key.removesuffix('.budget')}"  # its config group
        if scaling is None:
            require(
                context <= native,
                f"{key}={self.name} asks for a {context:,}-token context, past the model's {native:,} positions: pick "
                f"a budget within them (the embedded model's enlarged one is {group}=embedded_enlarged), or one whose "
                "rope_scaling (YaRN) covers it, as conf/budget/enlarged.yaml has",
            )
            return
        original, factor = scaling.get("original_max_position_embeddings", native), scaling.get("factor", 1.0)
        require(
            original == native,
            f"{key}={self.name}'s rope_scaling stretches {original:,} positions, but the model has {native:,}: it was "
            f"written for another model; pick a budget for this one (the embedded model's: {group}=embedded_enlarged)",
        )
        require(
            context <= original * factor,
            f"{key}={self.name} asks for a {context:,}-token context, past the {original * factor:,.0f} positions its "
            f"rope_scaling (x{factor} over {original:,}) covers: raise {key}.rope_scaling.factor to at least "
            f"{context / original:.2f} or shorten {key}.max_context_tokens",
        )

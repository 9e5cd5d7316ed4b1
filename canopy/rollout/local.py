"""`LocalEngine`: the `Engine` contract (`canopy.rollout.engine`) served in-process by the HF causal LM of the
checkpoint, float32 on the CPU in the embedded default (Sec. 3.1, token-in / token-out; Appendix I's enlarged
budget through `at_budget`); an episode's KV cache is kept between its turns (docs/local_engine.md).
"""

import contextlib
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from canopy.models import family_of
from canopy.rollout.engine import Generation, SamplingParams
from canopy.rollout.settings import LocalEngineSettings


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus (top-p) filtering of temperature-scaled logits [B, V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token crossing top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass
class _Session:
    """What the local engine keeps of an episode between its turns: the tokens its cache covers (the prompt and every
    generated token but the last, which was sampled and never fed) and, per layer, that cache as one batch row."""

    tokens: list[int]
    layers: list[dict[str, torch.Tensor]]  # "keys"/"values" [1, heads, length, dim]; "conv"/"recurrent" [1, ...]


def _cache_rows(cache, rows: slice, columns: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """Rows of a batched cache, per layer: attention keys and values (at `columns`, e.g. a row's own positions with its
    padding left out) and recurrent layers' conv and recurrent states (Qwen3.5's Gated DeltaNet), copied."""
    layers = []
    for layer in cache.layers:
        state = {}
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            keys, values = layer.keys[rows], layer.values[rows]
            state["keys"] = keys[:, :, columns] if columns is not None else keys.clone()
            state["values"] = values[:, :, columns] if columns is not None else values.clone()
        if getattr(layer, "has_previous_state", {}).get(0):
            state["conv"] = layer.conv_states[0][rows].clone()
            state["recurrent"] = layer.recurrent_states[0][rows].clone()
        layers.append(state)
    return layers


def _stacked_cache(config, blocks: list[tuple[list[dict[str, torch.Tensor]] | None, int]], width: int) -> DynamicCache:
    """One cache holding `blocks` one after another along the batch: (per-layer states from `_cache_rows`, or None for
    rows with nothing cached yet; their row count). Attention keys and values are left-padded to `width` positions (the
    caller masks the padding); recurrent layers have no positions, and an empty row's zero state is a fresh start."""
    cache = DynamicCache(config=config)
    template = next((layers for layers, _ in blocks if layers is not None), None)
    for index, like in enumerate(template or []):
        parts = {name: [layers[index][name] if layers else None for layers, _ in blocks] for name in like}
        counts = [n for _, n in blocks]
        if "keys" in like:
            keys, values = (_left_padded(parts[name], counts, width, like[name]) for name in ("keys", "values"))
            cache.update(keys, values, index)
        if "conv" in like:
            conv, recurrent = (_stacked(parts[name], counts, like[name]) for name in ("conv", "recurrent"))
            cache.update_conv_state(conv, index, conv_kernel_size=conv.shape[-1])
            cache.update_recurrent_state(recurrent, index)
    return cache


def _left_padded(parts: list[torch.Tensor | None], counts: list[int], width: int, like: torch.Tensor) -> torch.Tensor:
    """Blocks of keys or values [n, heads, length, dim] (None: n rows of nothing) stacked, left-padded to `width`."""
    out = like.new_zeros((sum(counts), like.shape[1], width, like.shape[3]))
    row = 0
    for part, n in zip(parts, counts):
        if part is not None:
            out[row : row + n, :, width - part.shape[2] :] = part
        row += n
    return out


def _stacked(parts: list[torch.Tensor | None], counts: list[int], like: torch.Tensor) -> torch.Tensor:
    """Blocks of recurrent states [n, ...] (None: n zero states) stacked."""
    return torch.cat(
        [part if part is not None else like.new_zeros((n, *like.shape[1:])) for part, n in zip(parts, counts)]
    )


class LocalEngine:
    """Batched sampling from the HF causal LM of the checkpoint (Qwen3, Qwen3.5), in-process: float32 on the CPU by
    default, or `dtype` on `device` (a GPU's bf16 engine, whose gap to the trainer the device check measures). Tokens
    are drawn on the CPU from the seeded generator.

    Like SGLang's radix cache, it keeps each episode's cache between its turns (`keys` name the episodes): the next
    turn prefills only what its prompt adds, the last sampled token, the observation and the next generation prompt.
    A group's identical first prompt is prefilled once for all its episodes. Sessions are dropped when their episode
    ends (`release`) and when the weights change; past `session_tokens` cached tokens in all, an episode's next turn
    prefills its whole history again, as it would without sessions. `counters` count what was prefilled and decoded.
    """

    weight_version: int
    dtype: str
    counters: Counter  # prefill_tokens, decode_tokens, session_hits, session_misses, sessions_over_cap
    concurrent = False  # a batch at a time: the agent loop gathers the episodes' requests
    can_relaunch = False  # no servers: `at_budget` serves every budget in-process

    def __init__(
        self,
        model_path: str | Path,
        stop_token_ids: list[int],
        pad_token_id: int,
        seed: int = 0,
        rope_scaling: dict | None = None,
        settings: LocalEngineSettings | None = None,
    ):
        """`rope_scaling` (e.g. YaRN for the enlarged budget, Appendix I) overrides the HF config's RoPE on load;
        `settings` is `engine.local` (dtype, device, the session cap; its schema's defaults when not given)."""
        self.settings = settings = settings or LocalEngineSettings()
        self.model_path, self.rope_scaling, self.seed = model_path, rope_scaling, seed
        self.dtype, self.device, self.session_tokens = (
            settings.dtype,
            torch.device(settings.device),
            settings.session_tokens,
        )
        dtype = settings.dtype
        self.siblings: dict[str, LocalEngine] = {}  # the same weights at other RoPE scalings, by `at_budget`
        config = AutoConfig.from_pretrained(model_path)
        if rope_scaling:
            config.rope_parameters = {**config.rope_parameters, **rope_scaling}
        family = family_of(config.to_dict())
        if family is not None and family.hf_on_cpu is not None and self.device.type == "cpu":
            family.hf_on_cpu()  # e.g. Qwen3.5: fla's Triton kernels cannot run on the CPU
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=getattr(torch, dtype))
        self.model = model.to(self.device).eval()
        text_config = self.model.config.get_text_config(decoder=True)
        # padding inside a continued prefill would flow into a recurrent layer's state: such models prefill the
        # continuations of equal length together, attention-only ones every continuation in one padded batch
        self.recurrent = "linear_attention" in (getattr(text_config, "layer_types", None) or [])
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)))
        self.pad_token_id = pad_token_id
        self.weight_version = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.sessions: dict[str, _Session] = {}
        self.sessions_lock = threading.Lock()  # `release` comes from the episodes' threads
        self.held_tokens = 0  # the sessions' tokens in all (`session_tokens` caps it)
        self.counters = Counter()  # prefill_tokens, decode_tokens, session_hits, session_misses, sessions_over_cap

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the trainer's weights one (HF name, tensor) pair at a time, then adopt its version.
        Every parameter must be updated: a partial update would mix two policies. Cached sessions are dropped."""
        params = dict(self.model.named_parameters())
        missing = set(params)
        self.release(list(self.sessions))  # computed with the old weights
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight update names {name!r}, which the engine's model does not have")
            params[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise RuntimeError(
                f"weight update to version {version} missed {sorted(missing)[:3]}: engine weights are mixed"
            )
        self.weight_version = version

    def at_budget(self, context_length: int, rope_scaling: dict | None) -> "LocalEngine":
        """Itself, or for another RoPE scaling an in-process sibling holding a copy of the current weights."""
        if (rope_scaling or None) == (self.rope_scaling or None):
            return self
        key = repr(sorted(rope_scaling.items())) if rope_scaling else "none"
        if key not in self.siblings:
            stops = self.stop_token_ids.tolist()
            self.siblings[key] = LocalEngine(
                self.model_path, stops, self.pad_token_id, self.seed, rope_scaling, self.settings
            )
        sibling = self.siblings[key]
        if sibling.weight_version != self.weight_version:
            sibling.update_weights(self.model.named_parameters(), self.weight_version)
        return sibling

    def relaunched(self, context_length: int, rope_scaling: dict | None):
        """Never: the local engine has no servers (`at_budget` serves every budget), and `can_relaunch` says so."""
        raise RuntimeError("the local engine has no servers to relaunch: `at_budget` serves every budget in-process")

    @contextlib.contextmanager
    def evaluation_seed(self, seed: int):
        state = self.generator.get_state()
        self.generator.manual_seed(seed)
        try:
            yield
        finally:
            self.generator.set_state(state)

    def rng_state(self) -> torch.Tensor:
        """The seeded token sampler's state (a checkpoint's `engine_rng`)."""
        return self.generator.get_state()

    def load_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def release(self, keys: Iterable[str]) -> None:
        """Drop the sessions of these episodes (they ended)."""
        with self.sessions_lock:
            for key in keys:
                self._pop_session(key)

    def _pop_session(self, key: str) -> _Session | None:
        """The episode's session, no longer held (the caller holds `sessions_lock`)."""
        session = self.sessions.pop(key, None)
        if session is not None:
            self.held_tokens -= len(session.tokens)
        return session

    def close(self) -> None:
        self.release(list(self.sessions))
        self.siblings.clear()

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        sampling: SamplingParams,
        keys: list[str | None] | None = None,
    ) -> list[Generation]:
        """One completion per prompt: prefill what each prompt adds to its episode's session, then decode the batch
        one token per step, dropping rows as they finish. Draws are the seeded generator's, one row of exponentials
        per prompt and step (what `torch.multinomial` draws), so batching does not change what is sampled."""
        batch = len(prompts)
        keys = keys or [None] * batch
        limits = torch.tensor(max_new_tokens)
        live = [i for i in range(batch) if max_new_tokens[i] > 0]
        tokens = torch.full((batch, max(max_new_tokens + [0])), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(tokens.shape)
        lengths, reasons = torch.zeros(batch, dtype=torch.long), ["length"] * batch
        if live:
            logits, cache, attention_mask = self._prefill([prompts[i] for i in live], [keys[i] for i in live])
            positions = torch.tensor([len(prompts[i]) for i in live], device=self.device)
            active = torch.tensor(live)  # the prompt each row of the batch answers
        for step in range(tokens.shape[1] if live else 0):
            scaled = logits.float().cpu() / sampling.temperature
            step_logprobs = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
            exponentials = torch.empty((batch, probs.shape[-1])).exponential_(1, generator=self.generator)
            sampled = (probs / exponentials[active]).argmax(-1)
            tokens[active, step] = sampled
            logprobs[active, step] = step_logprobs.gather(-1, sampled[:, None]).squeeze(-1)
            lengths[active] = step + 1
            stopped = torch.isin(sampled, self.stop_token_ids)
            done = stopped | (step + 1 >= limits[active])
            finished = torch.nonzero(done).flatten().tolist()
            if finished:
                answering, stops = active.tolist(), stopped.tolist()
                for row in finished:
                    prompt = answering[row]
                    reasons[prompt] = "stop" if stops[row] else "length"
                    if keys[prompt] is not None:
                        covers = prompts[prompt] + tokens[prompt, :step].tolist()
                        self._keep(keys[prompt], covers, cache, row, torch.nonzero(attention_mask[row]).flatten())
            if len(finished) == len(active):
                break
            if finished:
                going = torch.nonzero(~done).flatten()
                cache.reorder_cache(going.to(self.device))
                active, sampled, attention_mask, positions = (
                    active[going],
                    sampled[going],
                    attention_mask[going.to(self.device)],
                    positions[going.to(self.device)],
                )
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=-1)
            out = self.model(
                input_ids=sampled[:, None].to(self.device),
                attention_mask=attention_mask,
                position_ids=positions[:, None],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits, positions = out.logits[:, -1, :], positions + 1
            self.counters["decode_tokens"] += len(active)
        used = int(lengths.max()) if batch else 0  # the columns any row generated into
        token_rows, logprob_rows = tokens[:, :used].tolist(), logprobs[:, :used].tolist()
        return [
            Generation(token_rows[i][:n], logprob_rows[i][:n], reasons[i], self.weight_version)
            for i, n in enumerate(lengths.tolist())
        ]

    def _prefill(self, prompts: list[list[int]], keys: list[str | None]):
        """Bring every prompt into one batched cache: from its episode's session where the engine holds one whose
        tokens the prompt extends, else from scratch, identical fresh prompts once. Returns each prompt's logits at its
        last token, the cache and its attention mask (left and inner padding masked)."""
        pasts, suffixes = [], []
        for prompt, key in zip(prompts, keys):
            with self.sessions_lock:
                session = self._pop_session(key) if key is not None else None
            extends = session is not None and prompt[: len(session.tokens)] == session.tokens
            if extends and len(session.tokens) < len(prompt):
                self.counters["session_hits"] += 1
            else:
                self.counters["session_misses"] += session is not None
                session = None
            pasts.append(session)
            suffixes.append(prompt[len(session.tokens) :] if session else prompt)
        unique: dict[tuple, int] = {}  # a fresh prompt -> the first row with it; continuations are never shared
        source = [unique.setdefault(tuple(p), i) if pasts[i] is None else i for i, p in enumerate(prompts)]
        groups: dict[object, list[int]] = {}
        for i in sorted(set(source)):
            together = pasts[i] is None or not self.recurrent
            groups.setdefault("together" if together else len(suffixes[i]), []).append(i)
        done = [self._prefill_group(rows, pasts, suffixes) for rows in groups.values()]
        if len(done) == 1:
            ((logits, cache, attention_mask),) = done
        else:  # recurrent models' continuations of different lengths: one cache for all groups
            width = max(mask.shape[1] for _, _, mask in done)
            blocks = [(_cache_rows(c, slice(None)), len(mask)) for _, c, mask in done]
            cache = _stacked_cache(self.model.config, blocks, width)
            attention_mask = torch.cat([F.pad(mask, (width - mask.shape[1], 0)) for _, _, mask in done])
            logits = torch.cat([logits for logits, _, _ in done])
        prefilled = [i for rows in groups.values() for i in rows]  # the cache's rows, in order
        order = torch.tensor([prefilled.index(source[i]) for i in range(len(prompts))], device=self.device)
        if not torch.equal(order, torch.arange(len(order), device=self.device)):
            cache.reorder_cache(order)  # a shared prompt's row, repeated for each of its episodes
        return logits[order], cache, attention_mask[order]

    def _prefill_group(self, rows: list[int], pasts: list, suffixes: list[list[int]]):
        """One forward over these rows' suffixes on top of their sessions' caches, suffixes left-padded. Returns the
        logits at each row's last token, the cache and its attention mask."""
        past_lengths = [len(pasts[i].tokens) if pasts[i] else 0 for i in rows]
        suffix_lengths = [len(suffixes[i]) for i in rows]
        past_width, suffix_width = max(past_lengths), max(suffix_lengths)
        blocks = [(pasts[i].layers if pasts[i] else None, 1) for i in rows]
        cache = _stacked_cache(self.model.config, blocks, past_width)
        input_ids = torch.full((len(rows), suffix_width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), past_width + suffix_width), dtype=torch.long)
        position_ids = torch.zeros((len(rows), suffix_width), dtype=torch.long)
        for r, (i, past, length) in enumerate(zip(rows, past_lengths, suffix_lengths)):
            input_ids[r, suffix_width - length :] = torch.tensor(suffixes[i])
            attention_mask[r, past_width - past : past_width] = 1
            attention_mask[r, past_width + suffix_width - length :] = 1
            position_ids[r, suffix_width - length :] = torch.arange(past, past + length)
        attention_mask = attention_mask.to(self.device)
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask,
            position_ids=position_ids.to(self.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.counters["prefill_tokens"] += sum(suffix_lengths)
        return out.logits[:, -1, :], out.cache, attention_mask

    def _keep(self, key: str, tokens: list[int], cache, row: int, columns: torch.Tensor) -> None:
        """Keep a finished row's cache (its `columns`: no padding) as its episode's session, within `session_tokens`
        cached tokens in all."""
        with self.sessions_lock:
            self._pop_session(key)
            if self.held_tokens + len(tokens) > self.session_tokens:
                self.counters["sessions_over_cap"] += 1
                return
            self.sessions[key] = _Session(tokens, _cache_rows(cache, slice(row, row + 1), columns))
            self.held_tokens += len(tokens)

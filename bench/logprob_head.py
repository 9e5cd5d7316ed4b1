"""Peak memory and time of the chunked logprob head against the whole logits it replaces.

One forward and backward of the trainer's log-probability head (upstream gradients on both the target logprobs and
the entropies, as the loss gives them): the baseline forms the [tokens, vocab] logits `hidden @ weight.T` and runs
`token_logprobs` on them (what the trainer did before); `chunked_token_logprobs` never holds more than `--chunk`
rows of logits. Peaks are bytes allocated above the inputs (hidden states, weight, targets), which exist before;
both paths run in the same process, and the table prints the chunked path's peak and time as ratios to the
baseline's. The logits' memory, what is measured, does not depend on `--hidden` (only the weight and the matmuls'
cost do), so the CPU default keeps the matmuls cheap. The baseline's peak is 5 float32 copies of the logits (in
float32 and bf16 alike); one that would not fit is skipped. The chunked path, which always runs, peaks at about two
float32 copies of one chunk's logits plus the weight's gradient, whatever the tokens; `plan` is what the memory plan
(`canopy.memory.logprob_head_bytes`) predicts for it. The last line, `RESULT {json}`, holds the numbers.

    python bench/logprob_head.py [--tokens 4096 8192 16384 32768 --vocab 151936 --hidden 256 --chunk 2048
                                  --dtype float32|bfloat16 --device cpu|cuda --repeats 3 (1 on cpu)]
"""

import argparse
import json
import statistics
import time

import torch

from canopy.memory import logprob_head_bytes
from canopy.models.logprob_head import chunked_token_logprobs, token_logprobs
from canopy.tools.memory_measure import measure

GIB = 2**30
TEMPERATURE = 1.0
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # on logprobs; bf16 logits of the two paths' matmuls may differ
MARGIN = 0.8  # the baseline runs only if its estimated need is under this fraction of the free memory


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def step(path, inputs) -> torch.Tensor:
    """Forward and backward of one path; returns its logprobs (detached) and leaves no gradient behind."""
    hidden, weight, targets, upstream = inputs
    logprobs, entropy = path(hidden, weight, targets)
    (logprobs * upstream[0] + entropy * upstream[1]).sum().backward()
    hidden.grad = weight.grad = None
    return logprobs.detach()


def run(path, inputs, device: torch.device, repeats: int) -> tuple[torch.Tensor, int, float]:
    """The path's logprobs, peak bytes and median time; every repeat is both measured and timed (on CPU the
    profiler's cost is per op, small against runs of seconds)."""
    peaks, times = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        logprobs, measured = measure(lambda: step(path, inputs), device)  # synchronizes on cuda
        times.append(time.perf_counter() - started)
        peaks.append(measured.peak)
    return logprobs, max(peaks), statistics.median(times)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen3's
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16" if cuda else "float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    parser.add_argument("--repeats", type=int, default=3 if cuda else 1)  # a CPU run at 32k tokens takes minutes
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    whole = lambda h, w, t: token_logprobs(h @ w.T, t, TEMPERATURE)  # noqa: E731
    chunked = lambda h, w, t: chunked_token_logprobs(h, w, t, TEMPERATURE, args.chunk)  # noqa: E731
    print(
        f"vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk}, {args.dtype} on {args.device}; "
        f"peaks in GiB above the inputs, times in s (median of {args.repeats})"
    )
    print(
        f"{'tokens':>7} {'whole GiB':>10} {'chunk GiB':>10} {'ratio':>7} {'whole s':>9} {'chunk s':>9} {'ratio':>7} "
        f"{'plan GiB':>9} {'plan/chunk':>10}"
    )
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device=device) / args.hidden**0.5).to(dtype).requires_grad_()
    checked, rows = False, []
    for tokens in args.tokens:
        hidden = torch.randn(tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
        targets = torch.randint(0, args.vocab, (tokens,), device=device)
        inputs = hidden, weight, targets, torch.randn(2, tokens, device=device)
        chunk_logprobs, chunk_peak, chunk_time = run(chunked, inputs, device, args.repeats)
        plan = logprob_head_bytes(tokens, args.vocab, args.hidden, args.chunk, dtype.itemsize)
        row = dict(tokens=tokens, chunk_gib=chunk_peak / GIB, chunk_s=chunk_time, plan_gib=plan / GIB)
        rows.append(row)
        planned = f"{plan / GIB:>9.3f} {plan / chunk_peak:>9.3f}x"
        need, free = 5 * tokens * args.vocab * 4, available_bytes(device)
        if need > MARGIN * free:
            print(
                f"{tokens:>7} {'-':>10} {chunk_peak / GIB:>10.3f} {'-':>7} {'-':>9} {chunk_time:>9.3f} {'-':>7} "
                f"{planned}   baseline skipped: needs ~{need / GIB:.1f} GiB, this machine has {free / GIB:.1f} free"
            )
            continue
        whole_logprobs, whole_peak, whole_time = run(whole, inputs, device, args.repeats)
        row.update(whole_gib=whole_peak / GIB, whole_s=whole_time)
        print(
            f"{tokens:>7} {whole_peak / GIB:>10.3f} {chunk_peak / GIB:>10.3f} {chunk_peak / whole_peak:>6.3f}x "
            f"{whole_time:>9.3f} {chunk_time:>9.3f} {chunk_time / whole_time:>6.2f}x {planned}"
        )
        if not checked:  # on the first size the baseline runs on
            difference, tolerance = (chunk_logprobs - whole_logprobs).abs().max().item(), TOLERANCE[args.dtype]
            verdict = "agree" if difference < tolerance else "DISAGREE"
            print(f"        logprobs {verdict}: max abs difference {difference:.2e} (tolerance {tolerance:.0e})")
            checked = True
            row.update(max_abs_difference=difference, agree=difference < tolerance)
    config = dict(vocab=args.vocab, hidden=args.hidden, chunk=args.chunk, dtype=args.dtype, device=args.device)
    print("RESULT " + json.dumps(dict(config, rows=rows)))


if __name__ == "__main__":
    main()

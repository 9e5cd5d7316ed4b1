"""SWE-bench data for Canopy (Appendix H): convert rows, filter them in the paper's order, cache images, and
generate small SWE-style tasks.

    python -m canopy.tools.swe_data convert rebench|verified ROWS.jsonl OUT.jsonl
    python -m canopy.tools.swe_data filter INSTANCES.jsonl OUT.jsonl --verified VERIFIED.jsonl --tokenizer MODEL_DIR
        [--image-root DIR | --runtime docker] [--materialize skopeo|docker|podman] [--check-gold]
        [--max-prompt-tokens 4096] [--report REPORT.json]
    python -m canopy.tools.swe_data cache-images INSTANCES.jsonl --image-root DIR [--tool skopeo|docker|podman]
    python -m canopy.tools.swe_data generate OUT_DIR [--tasks 8] [--dev 0] [--seed 0] [--docker-base IMAGE]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from canopy.tools.swe_data.cache_images import cache_images
from canopy.tools.swe_data.convert import convert_rebench, convert_verified
from canopy.tools.swe_data.filter import VERIFIED_REPOS, filter_instances
from canopy.tools.swe_data.generate import generate
from canopy.tools.swe_data.instances import read_jsonl, write_jsonl


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m canopy.tools.swe_data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="SWE-rebench or Verified rows -> swebench 5.x instances")
    convert.add_argument("source", choices=("rebench", "verified"))
    convert.add_argument("rows")
    convert.add_argument("out")
    filt = commands.add_parser("filter", help="Appendix H's filters, in order, with a report")
    filt.add_argument("instances")
    filt.add_argument("out")
    filt.add_argument("--verified", help="Verified instances (their repos are dropped); default: its 12 repos")
    filt.add_argument("--tokenizer", required=True, help="the policy's HF checkpoint directory")
    filt.add_argument("--enable-thinking", action="store_true", help="Table A3 disables thinking")
    filt.add_argument("--max-prompt-tokens", type=int, default=4096)
    filt.add_argument("--image-root", help="unpacked images (bwrap); without it: --runtime")
    filt.add_argument("--runtime", default="auto", choices=("auto", "bwrap", "docker", "podman"))
    filt.add_argument("--check-gold", action="store_true", help="also: the gold patch resolves, an empty one does not")
    filt.add_argument("--materialize", choices=("skopeo", "docker", "podman"), help="pull / unpack the images first")
    filt.add_argument("--report", help="write the stage reports and drop reasons here (JSON)")
    cache = commands.add_parser("cache-images", help="materialize the images so that training never pulls")
    cache.add_argument("instances")
    cache.add_argument("--image-root", required=True)
    cache.add_argument("--tool", default="skopeo", choices=("skopeo", "docker", "podman"))
    gen = commands.add_parser("generate", help="small SWE-style tasks with their images (needs bubblewrap)")
    gen.add_argument("out")
    gen.add_argument("--tasks", type=int, default=8)
    gen.add_argument("--dev", type=int, default=0, help="of which this many go to dev.jsonl")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--docker-base", help="also build each task as a docker image on this base image")
    args = parser.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731

    if args.command == "convert":
        converter = convert_rebench if args.source == "rebench" else convert_verified
        rows = read_jsonl(args.rows)
        instances, failed = [], []
        for row in rows:
            try:
                instances.append(converter(row))
            except ValueError as error:
                failed.append(str(error))
        write_jsonl(args.out, instances)
        print(
            json.dumps(
                {"rows": len(rows), "converted": len(instances), "failed": len(failed), "first_failure": failed[:1]}
            )
        )
        if not instances:
            sys.exit(f"error: no row converted; first failure: {failed[0] if failed else 'no rows'}")
    elif args.command == "filter":
        from canopy.envs.isolation import RuntimeSettings, build_runtime, check_runtime

        settings = RuntimeSettings(kind="bwrap" if args.image_root else args.runtime, image_root=args.image_root)
        check_runtime(settings)
        verified = {i["repo"] for i in read_jsonl(args.verified)} if args.verified else set(VERIFIED_REPOS)
        instances = read_jsonl(args.instances)
        if args.materialize:  # stage (i) starts by pulling / unpacking; what fails is dropped by the check below
            cache_images(instances, Path(args.image_root or "."), args.materialize, log)
        with tempfile.TemporaryDirectory(prefix="canopy-filter-") as scratch:  # the check's sandboxes
            kept, reports, dropped = filter_instances(
                instances, build_runtime(settings, scratch), verified, args.tokenizer, args.max_prompt_tokens,
                args.check_gold, {"enable_thinking": args.enable_thinking}, log,
            )  # fmt: skip
        write_jsonl(args.out, kept)
        for report in reports:
            print(json.dumps(report))
        if args.report:
            Path(args.report).write_text(json.dumps({"stages": reports, "dropped": dropped}, indent=2))
    elif args.command == "cache-images":
        failed = cache_images(read_jsonl(args.instances), Path(args.image_root), args.tool, log)
        print(json.dumps({"failed": failed}))
        if failed:
            sys.exit(f"error: {len(failed)} image(s) not materialized; first: {next(iter(failed.items()))}")
    elif args.command == "generate":
        splits = {"train": args.tasks - args.dev, **({"dev": args.dev} if args.dev else {})}
        paths = generate(args.out, args.tasks, args.seed, splits, args.docker_base)
        print(json.dumps({split: str(path) for split, path in paths.items()}))


if __name__ == "__main__":
    main()

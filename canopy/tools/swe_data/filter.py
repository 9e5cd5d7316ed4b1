"""`filter` applies Appendix H in order, reporting counts, distinct repos and mean prompt tokens after each stage
(the paper: 5,639 tasks, 1,667 repos, 1,821 mean prompt tokens): (i) the image is materialized on this machine
(`--materialize TOOL` pulls / unpacks it first, as `cache-images` does) and a sandbox starts at `base_commit` (with
`--check-gold`, also: the gold patch resolves and an empty patch does not), (ii) every instance of a repository
that appears in Verified is dropped, (iii) the prompt (mini-swe-agent's messages in the policy's chat template) is
at most 4,096 tokens.
"""

VERIFIED_REPOS = (  # the 12 repositories of SWE-bench Verified (Appendix H), used when no Verified file is given
    "astropy/astropy", "django/django", "pallets/flask", "matplotlib/matplotlib", "pylint-dev/pylint",
    "pytest-dev/pytest", "psf/requests", "scikit-learn/scikit-learn", "mwaskom/seaborn", "sphinx-doc/sphinx",
    "sympy/sympy", "pydata/xarray",
)  # fmt: skip


def stage_report(name: str, instances: list[dict], prompt_tokens: dict[str, int] | None = None) -> dict:
    report = {"stage": name, "instances": len(instances), "repos": len({i["repo"] for i in instances})}
    if prompt_tokens is not None and instances:
        report["mean_prompt_tokens"] = round(
            sum(prompt_tokens[i["instance_id"]] for i in instances) / len(instances), 1
        )
    return report


def materializable(runtime, instance: dict, check_gold: bool) -> str | None:
    """None when the image is here and a sandbox starts at `base_commit` (and, with `check_gold`, the gold patch
    resolves and an empty patch does not); else why not."""
    from canopy.envs.base import EnvironmentFault
    from canopy.envs.isolation import SandboxError
    from canopy.envs.swe_grading import grade, run_tests, score_log

    if not runtime.has_image(instance["image"]):
        return "image not materialized"
    try:
        sandbox = runtime.start(instance["image"])
        try:
            head = sandbox.run("git rev-parse HEAD", 120).output.strip()
            if head != instance["base_commit"]:
                return f"HEAD {head[:12]} is not base_commit {instance['base_commit'][:12]}"
            if check_gold:
                log, _ = run_tests(sandbox, instance, 1800)
                if score_log(instance, log)[2]:
                    return "an empty patch resolves it"
        finally:
            sandbox.close()
        gold = grade(runtime, instance, instance["patch"], 1800) if check_gold else None
        if gold is not None and gold.outcome != "resolved":
            guarded = f" (the tamper guard restored {', '.join(gold.tampered)})" if gold.tamper else ""
            return f"the gold patch does not resolve it{guarded}"
    except (SandboxError, EnvironmentFault) as error:
        return f"sandbox failed: {error}"
    return None


def prompt_lengths(instances: list[dict], tokenizer_dir: str, template_kwargs: dict) -> dict[str, int]:
    """Tokens of each instance's opening prompt: mini-swe-agent's messages in the policy's chat template."""
    from transformers import AutoTokenizer

    from canopy.envs.swebench import harness
    from canopy.rollout.chat import ChatTokenizer, render_prompt

    tokenizer = ChatTokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), **template_kwargs)
    return {
        i["instance_id"]: len(render_prompt(tokenizer, harness().messages(i["problem_statement"]))) for i in instances
    }


def filter_instances(
    instances: list[dict], runtime, verified_repos: set[str], tokenizer_dir: str, max_prompt_tokens: int = 4096,
    check_gold: bool = False, template_kwargs: dict | None = None, progress=print,
) -> tuple[list[dict], list[dict], dict[str, str]]:  # fmt: skip
    """Appendix H's filters in order; returns (kept instances, a report per stage, why each dropped one went)."""
    dropped: dict[str, str] = {}
    reports = [stage_report("input", instances)]
    kept = []
    for n, instance in enumerate(instances, start=1):
        why = materializable(runtime, instance, check_gold)
        if why is None:
            kept.append(instance)
        else:
            dropped[instance["instance_id"]] = f"(i) {why}"
        if n % 100 == 0 or n == len(instances):
            progress(f"(i) images: {n}/{len(instances)} checked, {len(kept)} kept")
    reports.append(stage_report("(i) image materializable", kept))
    after_dedup = []
    for instance in kept:
        if instance["repo"] in verified_repos:
            dropped[instance["instance_id"]] = f"(ii) repository {instance['repo']} is in SWE-bench Verified"
        else:
            after_dedup.append(instance)
    reports.append(stage_report("(ii) repo-level dedup vs Verified", after_dedup))
    lengths = prompt_lengths(after_dedup, tokenizer_dir, template_kwargs or {})
    final = []
    for instance in after_dedup:
        if lengths[instance["instance_id"]] <= max_prompt_tokens:
            final.append(instance)
        else:
            dropped[instance["instance_id"]] = (
                f"(iii) prompt {lengths[instance['instance_id']]} > {max_prompt_tokens} tokens"
            )
    reports.append(stage_report(f"(iii) prompt <= {max_prompt_tokens} tokens", final, lengths))
    return final, reports, dropped

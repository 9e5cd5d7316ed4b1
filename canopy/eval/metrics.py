"""Evaluation metrics of Section 4.1 / Table 3, pure Python.

`runs` maps a task id to its k sampled outcomes (1.0 = every unit test passed). TGC is the fraction of tasks
solved; SGC the mean over scenarios of the minimum task success (a scenario counts only if all its tasks pass).
mean@k averages a metric over the k runs; best@k takes the per-task union over the k runs first.
"""

from collections import defaultdict

from canopy.envs.base import Task


def mean_at_k(runs: dict[str, list[float]]) -> float:
    """Average TGC over k runs: the mean over tasks of each task's mean outcome."""
    return sum(sum(r) / len(r) for r in runs.values()) / len(runs)


def best_at_k(runs: dict[str, list[float]]) -> float:
    """TGC of the per-task union over k runs: a task counts if any run solved it."""
    return sum(max(r) for r in runs.values()) / len(runs)


def sgc(success: dict[str, float], scenario: dict[str, str]) -> float:
    """Scenario goal completion: the mean over scenarios of the minimum success of their tasks."""
    by_scenario: dict[str, list[float]] = defaultdict(list)
    for task_id, value in success.items():
        by_scenario[scenario[task_id]].append(value)
    return sum(min(v) for v in by_scenario.values()) / len(by_scenario)


def sgc_mean_at_k(runs: dict[str, list[float]], scenario: dict[str, str]) -> float:
    """SGC averaged over the k runs (run j of every task forms one evaluation pass)."""
    k = min(len(r) for r in runs.values())
    return sum(sgc({t: r[j] for t, r in runs.items()}, scenario) for j in range(k)) / k


def sgc_best_at_k(runs: dict[str, list[float]], scenario: dict[str, str]) -> float:
    """SGC of the per-task union over the k runs."""
    return sgc({t: max(r) for t, r in runs.items()}, scenario)


def summarize(tasks: list[Task], runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """{"all" | "tier<K>": {tasks, tgc_mean, tgc_best, sgc_mean, sgc_best}} over the tasks with at least one
    scored run. SGC is given only where scenarios group several tasks."""
    scored = [t for t in tasks if runs.get(t.task_id)]
    subsets = {"all": scored}
    for tier in sorted({t.tier for t in scored}):
        subsets[f"tier{tier}"] = [t for t in scored if t.tier == tier]
    result = {}
    for name, subset in subsets.items():
        sub_runs = {t.task_id: runs[t.task_id] for t in subset}
        scenario = {t.task_id: t.scenario for t in subset}
        row = {"tasks": len(subset), "tgc_mean": mean_at_k(sub_runs), "tgc_best": best_at_k(sub_runs)}
        if len(set(scenario.values())) < len(subset):
            row.update(sgc_mean=sgc_mean_at_k(sub_runs, scenario), sgc_best=sgc_best_at_k(sub_runs, scenario))
        result[name] = row
    return result


def by_scenario(tasks: list[Task], runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """{scenario: {tasks, tgc_mean, tgc_best}} over the tasks with a scored run (SWE-bench: resolve rate per repo)."""
    grouped: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for t in tasks:
        if runs.get(t.task_id):
            grouped[t.scenario][t.task_id] = runs[t.task_id]
    return {
        scenario: {"tasks": len(sub), "tgc_mean": mean_at_k(sub), "tgc_best": best_at_k(sub)}
        for scenario, sub in sorted(grouped.items())
    }

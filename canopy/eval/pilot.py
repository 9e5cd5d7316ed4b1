"""The pilot of Section 3.2: the base policy's success rate per tier, the group size Eq. 5 recommends for a
target coverage tau, and the coverage P_sig (Eq. 4) each tier gets at common group sizes."""

from canopy.coverage import group_size_for_coverage, signal_coverage


def group_size_rule(p: float, episodes: int, tau: float) -> tuple[int | None, str]:
    """Eq. 5's n for a tier, with a note where the point estimate cannot be used as is."""
    if p <= 0.0:  # no success seen: p < 1/episodes, so the floor is at least Eq. 5 at that bound
        return group_size_for_coverage(1.0 / episodes, tau), f"no success in {episodes}: a floor, run a bigger pilot"
    if p >= 1.0:
        return None, "saturated: no group size gives signal"
    return group_size_for_coverage(p, tau), ""


def pilot_report(rates: dict[str, tuple[float, int]], tau: float, group_sizes: list[int]) -> dict:
    """`rates` maps a tier to (success rate, episodes). Returns per-tier n and P_sig, and the recommendation:
    Eq. 5 at the hardest tier's rate p_min."""
    tiers = {}
    for tier, (p, episodes) in rates.items():
        n, note = group_size_rule(p, episodes, tau)
        tiers[tier] = {
            "p": p,
            "episodes": episodes,
            "n_eq5": n,
            "note": note,
            "p_sig": {str(g): signal_coverage(p, g) for g in group_sizes},
        }
    hardest = min(rates, key=lambda t: rates[t][0])
    return {"tau": tau, "hardest": hardest, "recommended_group_size": tiers[hardest]["n_eq5"], "tiers": tiers}


def format_pilot(report: dict, group_sizes: list[int]) -> str:
    head = "| tier | p | episodes | n (Eq. 5) | " + " | ".join(f"P_sig n={g}" for g in group_sizes) + " |"
    rows = [head, "|" + "---|" * (4 + len(group_sizes))]
    for tier, row in report["tiers"].items():
        n = "-" if row["n_eq5"] is None else str(row["n_eq5"])
        p_sig = " | ".join(f"{row['p_sig'][str(g)]:.3f}" for g in group_sizes)
        rows.append(f"| {tier} | {row['p']:.3f} | {row['episodes']} | {n} | {p_sig} |")
    notes = [f"{t}: {row['note']}" for t, row in report["tiers"].items() if row["note"]]
    hardest = report["hardest"]
    rows += [
        "",
        f"Eq. 5 at the hardest tier ({hardest}, p_min={report['tiers'][hardest]['p']:.3f}) for coverage "
        f"tau={report['tau']}: group size n >= {report['recommended_group_size']}",
    ] + notes
    return "\n".join(rows)

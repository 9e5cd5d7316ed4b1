"""Read scalar series back from a run's TensorBoard logs (for reports, plots and tests)."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} over every event file under `log_dir`."""
    series: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            series.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return {tag: sorted(values) for tag, values in series.items()}

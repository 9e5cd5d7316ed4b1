"""What a run reports, apart from the recipe: figures (plots.py), the end-of-run summary (summary.py, with the
`report.*` schema), the rollout viewer page (viewer.py), the TensorBoard reader (tb_scalars.py) and the statistics
over seeds (stats.py). Library code: the callbacks, train.py and evaluate.py import it; the commands are in
canopy/tools/. This package imports none of its modules, so `ReportSettings` (canopy.config reads it) comes without
the plots."""

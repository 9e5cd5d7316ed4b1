"""Commands around the recipe, apart from it (`python -m canopy.tools.<name>`): the episode viewer and replay, the
fault soak, group sizes, the memory plan and measurement, the SWE attacks and data, the tiny model and the rollout
viewer's build. The top layer: nothing in canopy/ imports a tool (their library code is in canopy/reports/ and
canopy/tiny_model.py)."""

"""SWE-bench data for Canopy (Appendix H): `python -m canopy.tools.swe_data <command>` (`__main__`), one module per
command (`convert`, `filter`, `cache_images`, `generate`) and the JSONL and eval-script helpers they share
(`instances`)."""

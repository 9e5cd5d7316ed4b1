"""An environment worker process: `python -m canopy.envs.worker FACTORY KWARGS_JSON MEMORY_MB`.

It hosts one episode at a time of the environment `FACTORY` ("module:Class", built with KWARGS_JSON) under
an address-space cap, and answers framed requests from `canopy.envs.pool` on a private pipe (fd 1 is moved to
stderr so nothing the environment prints can corrupt the channel). Replies say whose fault a failure was:
("ok", value), ("agent_failure", reason, detail) or ("fault", reason, detail). Every request names its
episode; a request for another episode than the one hosted is cross-episode corruption. When the pool's
process is gone (its pipe ends, or a reply finds nobody reading: kill -9, the OOM killer), the worker closes the
episode it hosts, so its sandbox and container go with it, and exits.
"""

import importlib
import json
import os
import pickle
import resource
import struct
import sys
import traceback

from canopy.envs.base import AgentFailure, EnvironmentFault

HEADER = struct.Struct("!I")


def write_frame(fd: int, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def read_exactly(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError("channel closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int):
    (size,) = HEADER.unpack(read_exactly(fd, HEADER.size))
    return pickle.loads(read_exactly(fd, size))


def build_environment(factory: str, kwargs: dict):
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


class Host:
    """The worker's state: the environment and the one episode it hosts."""

    def __init__(self, env):
        self.env, self.episode, self.episode_id = env, None, None

    def handle(self, op: str, episode_id: str | None, args: tuple):
        if op == "ping":
            return os.getpid()
        if op == "tasks":
            return self.env.tasks(*args)
        if op == "start":
            if self.episode is not None:
                raise EnvironmentFault("cross_episode_corruption", f"episode {self.episode_id} still hosted")
            self.episode, self.episode_id = self.env.start(*args), episode_id
            return self.episode.messages()
        if episode_id != self.episode_id or self.episode is None:
            raise EnvironmentFault("cross_episode_corruption", f"request for {episode_id}, hosting {self.episode_id}")
        if op == "step":
            return self.episode.step(*args)
        if op == "verdict":
            return self.episode.verdict()
        if op == "close":
            return self.close()
        raise ValueError(f"unknown request {op!r}")

    def close(self):
        """End the hosted episode, if any: asked by the pool, or because the pool is gone."""
        if self.episode is not None:
            episode, self.episode, self.episode_id = self.episode, None, None
            return episode.close()


def answer(host: Host, op: str, episode_id: str | None, args: tuple) -> tuple:
    """The reply to one request, saying whose fault a failure was (see the module docstring)."""
    try:
        return ("ok", host.handle(op, episode_id, args))
    except AgentFailure as failure:
        return ("agent_failure", failure.reason, failure.detail)
    except EnvironmentFault as fault:
        return ("fault", fault.reason, fault.detail)
    except MemoryError:
        raise
    except Exception as error:  # a bug in the environment, not the agent's doing
        return ("fault", "environment_error", "".join(traceback.format_exception_only(error)).strip())


def serve(requests: int, replies: int, host: Host) -> None:
    """Answer requests until the owner is gone: its end of the pipe closed, or a reply nobody reads."""
    while True:
        try:
            op, episode_id, args = read_frame(requests)
        except EOFError:
            return
        try:
            reply = answer(host, op, episode_id, args)
        except MemoryError:
            write_frame(replies, ("fault", "worker_oom", "the environment exceeded the worker's memory cap"))
            os._exit(1)  # its state may be half-updated: never serve another request
        try:
            write_frame(replies, reply)
        except BrokenPipeError:
            return


def main() -> None:
    factory, kwargs, memory_mb = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    replies = os.dup(1)
    os.dup2(2, 1)
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20,) * 2)
    host = Host(build_environment(factory, kwargs))
    write_frame(replies, ("ok", os.getpid()))  # ready
    try:
        serve(0, replies, host)
    finally:
        host.close()


if __name__ == "__main__":
    main()

"""The episode of an environment served elsewhere: a pool's worker process (`canopy.envs.pool`), a Ray node's actor
(`canopy.envs.ray_pool`)."""

from collections.abc import Callable

from canopy.envs.base import StepResult, Verdict


class RemoteEpisode:
    """One episode, pinned to its `host` (the pool's `Worker`, the Ray `Node`) until `close()`. The owner that
    started it passes its two functions: `call(host, episode_id, op, *args)` sends one request of the episode
    (`step`, `verdict`) there and returns the reply (its faults raised as the owner attributes them); `end(host,
    episode_id)` ends the episode there and hands the host back. After `close()` the host is None and a request
    raises."""

    def __init__(
        self,
        episode_id: str,
        messages: list[dict],
        host,
        call: Callable[..., object],
        end: Callable[[object, str], None],
    ):
        self.episode_id, self._messages, self.host, self._call, self._end = episode_id, messages, host, call, end

    def _request(self, op: str, *args):
        if self.host is None:
            raise RuntimeError(f"episode {self.episode_id} is closed")
        return self._call(self.host, self.episode_id, op, *args)

    def messages(self) -> list[dict]:
        return self._messages

    def step(self, action_text: str) -> StepResult:
        return self._request("step", action_text)

    def verdict(self) -> Verdict:
        return self._request("verdict")

    def close(self) -> None:
        """End the episode on its host and hand the host back, once."""
        if self.host is None:
            return
        host, self.host = self.host, None
        self._end(host, self.episode_id)

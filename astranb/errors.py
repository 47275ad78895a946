"""Errors astranb raises on purpose. Every one is an `AstranbError`, so a notebook can catch them
all at once; each also keeps the builtin base it has always had (ValueError, RuntimeError,
ConnectionError), so existing `except` clauses keep working.

    try:
        run.wait()
    except ab.AstranbError as error:
        print("astranb says:", error)

Errors that belong to one pure part stay next to it and inherit from here (the weight codec's
`WeightTransferError`, the SGLang engine's `SGLangError`, the services' `InsecureBind`).
"""

from __future__ import annotations

__all__ = [
    "AstranbError",
    "EpisodesKeepFailing",
    "NoTrainableTokens",
    "SamplesRanOut",
    "TrainerRolledBack",
    "ServiceError",
    "ServiceUnavailable",
    "NoRolloutService",
    "ServiceRejected",
    "ReplayError",
    "EpisodeTruncated",
    "SessionClosed",
    "FolderNotWritable",
]


class AstranbError(Exception):
    """Base class of the errors astranb raises on purpose."""


class EpisodesKeepFailing(AstranbError, RuntimeError):
    """Every recent episode raised: the environment (or engine) is broken, not unlucky."""


class NoTrainableTokens(AstranbError, RuntimeError):
    """Every recent episode of an environment ended before its policy sampled a token (a prompt
    longer than the model's context, a token budget of 0): nothing to train on, ever."""


class SamplesRanOut(AstranbError, RuntimeError):
    """Every sample stream of the run has ended (or yielded nothing) and a policy still needs
    groups for a step."""


class TrainerRolledBack(AstranbError, RuntimeError):
    """The trainer came back from a checkpoint older than the session's version: the steps
    after it are lost, and what their weights generated must not be trained on."""

    def __init__(self, policy: str, recovered: int, expected: int):
        super().__init__(f"trainer of {policy!r} recovered version {recovered} from its "
                         f"checkpoint; the session was at {expected}")
        self.policy, self.recovered, self.expected = policy, recovered, expected


class ServiceError(AstranbError, RuntimeError):
    """A service answered with an error (4xx/5xx): the request or the service is wrong."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message


class ServiceUnavailable(AstranbError, ConnectionError):
    """A service did not answer (connection refused, reset, timed out)."""


class NoRolloutService(AstranbError, RuntimeError):
    """No rollout service answered for longer than the pool's patience."""


class ServiceRejected(AstranbError, ValueError):
    """A rollout service refused the session's policies or environments (a setup error)."""


class ReplayError(AstranbError, RuntimeError):
    """A replayed episode needs a turn the recording lacks and no policy can sample it."""


class EpisodeTruncated(AstranbError):
    """An episode reached the model's context or its token budget. Raised by `ctx.chat` and
    `ctx.generate` before they would exceed either; `play_episode` ends the episode there as
    *truncated*: it keeps its turns, earns the environment's `truncated_reward` and is trained on
    like any other. An environment that catches `Exception` around its turns should re-raise it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class SessionClosed(AstranbError, RuntimeError):
    """A Session was used after `close()` (or after a newer Session took its folder)."""

    def __init__(self, directory: object):
        super().__init__(
            f"this Session on {directory} was closed (session.close(), or a newer Session of "
            "this process took its folder); its policies and engines are gone. Open a new "
            f"one: ab.Session({str(directory)!r})")
        self.directory = directory


class FolderNotWritable(AstranbError, OSError):
    """A Session's folder cannot be written (a read-only mount, no permission): astranb keeps
    its lock, metrics, episodes and checkpoints there."""

    def __init__(self, path: object, error: OSError):
        reason = error.strerror or str(error)
        super().__init__(
            error.errno, f"{path} is not writable ({reason}): a Session writes its lock file, "
            "its runs' metrics, episodes and checkpoints in its folder. Make the folder "
            "writable (or remount it read-write), or open the Session on a folder you can "
            "write: ab.Session('some/writable/folder'). To read runs already there, "
            "ab.open_run(path) needs no write access")
        self.path, self.error = path, error

    def __str__(self) -> str:
        return str(self.strerror)

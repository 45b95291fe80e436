"""The Ray Train side: a :class:`~lakestream_iceberg.read.dataset.LakestreamDataset` for the calling training worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lakestream_iceberg.errors import ConfigError

if TYPE_CHECKING:
    from lakestream_iceberg.format.table import StreamTable

__all__ = ["ray_train_dataset"]


def ray_train_dataset(stream: StreamTable, *, checkpoint: str | None = None, follow: bool = True, **kwargs: Any) -> Any:
    """A ``LakestreamDataset`` for this Ray Train worker: rank and world size from ``ray.train.get_context()``.

    Call it inside ``train_loop_per_worker``. ``checkpoint`` resumes after a checkpoint tag
    (``LakestreamDataset.from_checkpoint``); other keyword arguments are ``LakestreamDataset``'s (``end_step=``,
    ``timeout=``, ``collate=``, ...).

    Args:
        stream: The stream (a pickled ``Stream`` reopens by catalog name in the worker).
        checkpoint: Resume right after this checkpoint tag.
        follow: Wait for steps not published yet.
        **kwargs: ``LakestreamDataset``'s other keyword arguments.

    Returns:
        A ``LakestreamDataset`` for this worker's rank.

    Raises:
        ConfigError: Called outside a Ray Train training function, or given ``rank`` or ``world_size``.
        CheckpointError: No retained checkpoint has the name ``checkpoint``.

    Example:
        >>> def train_loop(config):                                                    # doctest: +SKIP
        ...     for item in ray_train_dataset(config["stream"], end_step=config["steps"]):
        ...         loss = model(item["tokens"]) ...
    """
    own = sorted(k for k in ("rank", "world_size") if k in kwargs)
    if own:  # LakestreamDataset would get them twice: Python's "got multiple values for keyword argument"
        raise ConfigError(f"ray_train_dataset takes rank and world size from ray.train.get_context() (this worker's "
                          f"world rank and the training run's world size), got {', '.join(own)}=: leave them out, or "
                          "make a LakestreamDataset(stream, rank=..., world_size=...) yourself")
    import ray.train

    from lakestream_iceberg.read.dataset import LakestreamDataset

    try:
        context = ray.train.get_context()
        rank, world_size = context.get_world_rank(), context.get_world_size()
    except Exception as exc:  # outside a Ray Train worker
        raise ConfigError(f"ray_train_dataset must be called inside a Ray Train training function ({exc})") from None
    if checkpoint is not None:
        return LakestreamDataset.from_checkpoint(stream, checkpoint, rank=rank, world_size=world_size, follow=follow, **kwargs)
    return LakestreamDataset(stream, rank=rank, world_size=world_size, follow=follow, **kwargs)

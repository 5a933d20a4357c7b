"""One rule for the engine's auto/on/off settings (cuda_graphs, async_batching, model_impl)."""

from __future__ import annotations

import logging

from cbrun.engine.setting_error import SettingError

logger = logging.getLogger("cbrun.engine")


def resolve_switch(
    name: str,
    setting: str,
    blocker: str | None,
    *,
    on: str = "on",
    off: str = "off",
    off_log: str | None = None,
    hint: str = "",
) -> bool:
    """Whether a feature runs: ``off`` never; ``auto`` unless something blocks it here; ``on`` or an error.

    Args:
        name: the setting's name, for messages.
        setting: its value: ``on``, ``off`` or "auto".
        blocker: why the feature cannot run in this engine, or None when it can.
        on, off: the setting's words for on and off (e.g. "triton" / "torch" for ``attention_backend``).
        off_log: %-format of the INFO line logged once when "auto" turns the feature off (one %s: the blocker);
            default "<name> off: <blocker>".
        hint: appended to the error, e.g. what to set instead.

    Returns:
        True when the feature runs.

    Raises:
        SettingError: when ``setting`` is ``on`` and ``blocker`` is set (a ValueError; a job names the setting
            ``engine.<name>``).
    """
    if setting == off:
        return False
    if blocker is None:
        return True
    if setting == on:
        raise SettingError("{" + name + "} = {on}, but {blocker}{hint}", on=on, blocker=blocker, hint=hint)
    logger.info(off_log or f"{name} off: %s", blocker)
    return False

"""Warm standby processes: started ahead by the agent, each becomes a rank at a restart.

:mod:`.pool` (the agent's pool), :mod:`.fork` (the agent's side of the fork server),
:mod:`.zygote` (the fork server process), :mod:`.worker` (a standby process until its hand-off).
"""

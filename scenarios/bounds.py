"""The bounds that several sections of the scenario schema share.

Every number a scenario holds has a range from its meaning, checked when the
file is read (:func:`scenarios.parse.within`): a count of clients or rounds
stays well inside a 64-bit store column, a wait inside what a timer can
hold, a learning rate below where a step already diverges. Keys with a
bound of their own keep it beside their check.
"""

from __future__ import annotations

__all__ = ["MAX_ROUNDS", "MAX_CLIENTS", "MAX_LR", "MAX_WAIT_S"]

#: The most rounds (or FedBuff steps) a run may ask for, and the most rounds of staleness.
MAX_ROUNDS = 1_000_000
#: The most clients a federation, a round or any count of clients may hold.
MAX_CLIENTS = 1_000_000
#: The largest learning rate, the clients' and the server's: a step of 100 times the update already diverges.
MAX_LR = 100.0
#: The longest wait a setting may ask for (a deadline, a timeout, a delay): one week, in seconds.
MAX_WAIT_S = 7 * 86_400.0

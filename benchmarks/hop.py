"""Figure 1, the broker hop: ``sparkbus.bench.hop`` (sparkbus's broker against ``zmq.proxy``, the C broker) at 1 KiB
to 4 MiB, and the same sparkbus hop with one thing changed, each against the plain hop of its size: CURVE
(``--auth``: what encryption costs), the feeder's packs off, a deeper prefetch, the rank's checksum off.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sparkbus.bench.hop import Variant, measure

from .common import KiB, MiB
from .sections import Context, Section

SIZES = (1 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)


def curve_variants(root: Path) -> list[Variant]:
    """The CURVE hops at 64 KiB and 1 MiB: a broker run with ``--auth`` over new keys, every client with its own."""
    from sparkbus.broker.auth import create_keypair

    auth, clients = root / "auth", root / "clients"
    for folder in (auth / "feeders", auth / "ranks", clients):
        folder.mkdir(parents=True)
    broker_key = str(create_keypair(auth / "broker")[0])
    keys = {}
    for role, folder in (("feeder", "feeders"), ("rank", "ranks")):
        public, secret = create_keypair(clients / f"bench-{role}")
        shutil.copy(public, auth / folder / public.name)
        keys[role] = {"key": str(secret), "broker_key": broker_key}
    return [Variant("sparkbus, CURVE", size, keys["feeder"], keys["rank"], ("--auth", str(auth)))
            for size in (64 * KiB, 1 * MiB)]


class HopSection(Section[list]):
    """Figure 1: the broker hop, its CPU, what CURVE costs, and diagnostics with one default changed."""

    name, title = "hop", "1. broker hop: sparkbus vs zmq.proxy"

    def measure(self, ctx: Context) -> list:
        variants = [*curve_variants(ctx.work / "curve-keys"),
                    Variant("sparkbus, prefetch 64", KiB, receive={"prefetch": 64}),
                    Variant("sparkbus, verify=False", MiB, receive={"verify": False}),
                    *(Variant("sparkbus, unpacked", size, {"pack_bytes": 0}) for size in (KiB, 64 * KiB))]
        return measure(ctx.work, ctx.sizes.reps, ctx.sizes.hop_seconds, max(30.0, ctx.sizes.hop_seconds * 20), SIZES,
                       variants)

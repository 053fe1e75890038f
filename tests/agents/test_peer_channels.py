"""Channels to peer agents are kept and dialled ahead (agents/peers/tls.py PeerChannels): a channel
dialled before it is needed has finished its mutual-TLS handshake when the first call comes, the
liveness streams and the replication links share one per peer, and channels nobody keeps close."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio

from ftrt.agents.peers.tls import AgentTls, PeerChannels
from ftrt.store.certs import tls_dir


async def _ready(channel: grpc.aio.Channel, timeout: float = 10.0) -> grpc.ChannelConnectivity:
    for _ in range(int(timeout / 0.05)):
        state = channel.get_state()
        if state is grpc.ChannelConnectivity.READY:
            return state
        await asyncio.sleep(0.05)
    return channel.get_state()


async def test_a_dialled_channel_is_connected_before_use_and_shared_until_dropped(tmp_path):
    files = tls_dir(tmp_path / "tls")
    tls = AgentTls(str(files.server_cert), str(files.server_key), str(files.ca)).check()
    server = grpc.aio.server()
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    await server.start()
    channels = PeerChannels(tls)
    addr = f"127.0.0.1:{port}"
    try:
        channel = channels.get(addr)
        assert channel.get_state() is grpc.ChannelConnectivity.IDLE  # made lazily: nothing dialled yet
        channels.dial(addr)
        assert await _ready(channel) is grpc.ChannelConnectivity.READY  # handshake done ahead of any call
        assert channels.get(addr) is channel  # one per peer: monitor and replicator share it
        channels.keep([addr])
        assert channels.get(addr) is channel and channel.get_state() is grpc.ChannelConnectivity.READY
        channels.keep([])
        await asyncio.sleep(0.1)
        assert channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN
        assert channels.get(addr) is not channel and channels.addresses == [addr]
    finally:
        await channels.close()
        await server.stop(0)

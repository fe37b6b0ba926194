"""Echo server and concurrent clients for the gateway SNAT namespace test.

server ADDR PORT STATS_FILE: on each connection, first sends "<peer ip> <peer port>\n" as the
server sees them, then echoes lines; writes the highest number of connections it held at once
to STATS_FILE whenever it grows.

client ADDR PORT N HOLD_S: opens N connections at once, reads each greeting, holds them all
open HOLD_S seconds, then sends one line on each and checks the echo; prints one JSON line:
{"ok": ..., "failed": [...], "peers": [[ip, port], ...]}.
"""
import asyncio
import json
import sys


async def serve(addr, port, stats_file):
    state = {"now": 0, "max": 0}

    async def handle(reader, writer):
        state["now"] += 1
        if state["now"] > state["max"]:
            state["max"] = state["now"]
            with open(stats_file, "w") as f:
                f.write(str(state["max"]))
        peer = writer.get_extra_info("peername")
        try:
            writer.write(f"{peer[0]} {peer[1]}\n".encode())
            await writer.drain()
            while line := await reader.readline():
                writer.write(line)
                await writer.drain()
        finally:
            state["now"] -= 1
            writer.close()

    server = await asyncio.start_server(handle, addr, port, backlog=2048)
    async with server:
        await server.serve_forever()


async def one(addr, port, i, hold, opened, all_open):
    reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, port), 10)
    greeting = (await asyncio.wait_for(reader.readline(), 10)).decode().split()
    opened[0] += 1
    if opened[0] == opened[1]:
        all_open.set()
    await asyncio.wait_for(all_open.wait(), 30)
    await asyncio.sleep(hold)
    msg = f"ping {i}\n".encode()
    writer.write(msg)
    await writer.drain()
    echo = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    if echo != msg:
        raise RuntimeError(f"echo {echo!r} for {msg!r}")
    return [greeting[0], int(greeting[1])]


async def clients(addr, port, n, hold):
    opened, all_open = [0, n], asyncio.Event()
    results = await asyncio.gather(
        *(one(addr, port, i, hold, opened, all_open) for i in range(n)),
        return_exceptions=True,
    )
    peers = [r for r in results if isinstance(r, list)]
    failed = [repr(r) for r in results if not isinstance(r, list)]
    print(json.dumps({"ok": len(peers), "failed": failed[:10], "peers": peers}))


if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(serve(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    else:
        asyncio.run(clients(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))

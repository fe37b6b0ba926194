"""Stock gRPC clients (PyPI's grpcio, grpcio-reflection, grpcio-health-checking) against the
daemon, for fastpath/tests/netns/grpc_tools.rs. Every channel is made with grpcio's
defaults: no authority override, no options.

session PROTO_DIR SOCKET TCP_ADDR BACKEND_ADDR BACKEND_PORT VIP: compiles fastpath.v1 from
PROTO_DIR with grpcio-tools (into a temporary directory: no generated code in the repository),
then over unix://SOCKET: GetInfo; opens WatchHealth; CreateServices (VIP:80 with a TCP health
check of BACKEND, where nothing listens) at the current generation; waits for the health event
it causes; CreateServices (VIP:81) at the generation that change made (current), then
(VIP:82) at it again (stale); lists the services by
reflection (v1alpha through grpcio-reflection's client, v1 by a raw call) and checks health.
Over TCP_ADDR (plain TCP): reflection and health again. Prints one JSON object with what it
saw; the Rust test judges it. Exits non-zero only when a step could not run at all.

watch-health SOCKET: grpc.health.v1.Health/Watch for "", printing each status on its own line
as it arrives, until the stream ends; then prints "END <code>".
"""
import json
import subprocess
import sys
import tempfile
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

TIMEOUT_S = 10


def compile_protos(proto_dir):
    out = tempfile.mkdtemp(prefix="fastpath-grpc-tools-")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "fastpath/v1/fastpath.proto",
        ],
        check=True,
    )
    sys.path.insert(0, out)
    from fastpath.v1 import fastpath_pb2, fastpath_pb2_grpc

    return fastpath_pb2, fastpath_pb2_grpc


def rpc_error(e):
    return {"code": e.code().name, "details": e.details()}


def reflection_v1_services(channel):
    """ListServices through grpc.reflection.v1, whose messages are those of v1alpha."""
    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    responses = call(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT_S
    )
    return sorted(s.name for r in responses for s in r.list_services_response.service)


def reflection_and_health(channel):
    seen = {}
    try:
        seen["reflection_v1alpha"] = sorted(
            ProtoReflectionDescriptorDatabase(channel).get_services()
        )
    except grpc.RpcError as e:
        seen["reflection_v1alpha"] = rpc_error(e)
    try:
        seen["reflection_v1"] = reflection_v1_services(channel)
    except grpc.RpcError as e:
        seen["reflection_v1"] = rpc_error(e)
    health = health_pb2_grpc.HealthStub(channel)
    seen["health"] = {}
    for service in ["", "fastpath.v1.Fastpath"]:
        try:
            r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
            seen["health"][service] = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            seen["health"][service] = rpc_error(e)
    return seen


def session(proto_dir, socket, tcp_addr, backend_addr, backend_port, vip):
    pb, pb_grpc = compile_protos(proto_dir)
    out = {}
    channel = grpc.insecure_channel(f"unix://{socket}")
    stub = pb_grpc.FastpathStub(channel)
    try:
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT_S)
    except grpc.RpcError as e:
        out["info"] = rpc_error(e)
        print(json.dumps(out))
        return
    out["info"] = {
        "api_version": info.api_version,
        "pid": info.pid,
        "generation": info.generation,
    }

    # The watch is open before the change that causes its event.
    events = []
    watch = stub.WatchHealth(pb.WatchHealthRequest())
    got_event = threading.Event()

    def read_watch():
        try:
            for ev in watch:
                events.append(
                    {
                        "vip": ev.backend.service.vip,
                        "port": ev.backend.service.port,
                        "address": ev.backend.address,
                        "backend_port": ev.backend.port,
                        "up": ev.backend.up,
                        "detail": ev.backend.detail,
                    }
                )
                got_event.set()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                events.append(rpc_error(e))
                got_event.set()

    reader = threading.Thread(target=read_watch, daemon=True)
    reader.start()

    def create(generation, port):
        spec = pb.ServiceSpec(
            key=pb.ServiceKey(vip=vip, port=port),
            backends=[pb.BackendSpec(address=backend_addr, port=int(backend_port))],
            health_check=pb.HealthCheckSpec(kind="tcp", interval_ms=100, timeout_ms=100, fall=1),
        )
        req = pb.ServicesRequest(services=[spec], expected_generation=generation)
        try:
            r = stub.CreateServices(req, timeout=TIMEOUT_S)
            return {"ok": True, "generation": r.generation, "created": list(r.created)}
        except grpc.RpcError as e:
            return rpc_error(e)

    out["create"] = create(info.generation, 80)
    got_event.wait(TIMEOUT_S)
    watch.cancel()
    reader.join(TIMEOUT_S)
    out["watch_events"] = events

    # Generation 0 skips the check: the next change carries the generation the first made,
    # which is current (accepted); the one after carries it again, stale by then. Each
    # creates a new service, so the generation is all that can be wrong with the last.
    current = out["create"].get("generation", 0)
    out["create_current"] = create(current, 81)
    out["stale_create"] = create(current, 82)
    out["generation_after"] = stub.GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT_S).generation

    out["unix"] = reflection_and_health(channel)
    out["tcp"] = reflection_and_health(grpc.insecure_channel(tcp_addr))
    print(json.dumps(out))


def watch_health(socket):
    channel = grpc.insecure_channel(f"unix://{socket}")
    health = health_pb2_grpc.HealthStub(channel)
    try:
        for r in health.Watch(health_pb2.HealthCheckRequest(service="")):
            print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status), flush=True)
        print("END OK", flush=True)
    except grpc.RpcError as e:
        print(f"END {e.code().name}", flush=True)


def main():
    if len(sys.argv) == 8 and sys.argv[1] == "session":
        session(*sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "watch-health":
        watch_health(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()

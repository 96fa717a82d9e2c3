#!/usr/bin/env python3
"""Calls `idem-demo grpc-serve` from Python's grpcio, with stubs generated from
demo/grpc/payments.proto (docs/grpc.md says how), and checks what idem answers:

    python3 demo/grpc/client.py 127.0.0.1:PORT

Prints each answer's status and trailing metadata; exits 1 on the first one that is not what
docs/grpc.md documents."""
import sys
import uuid

import grpc

import payments_pb2
import payments_pb2_grpc

AUTH = ("authorization", "Bearer sk_test_alpha")


def call(stub, request, key):
    """One Charge; returns (status code, reply or None, trailing metadata as a dict)."""
    metadata = [AUTH] + ([("idempotency-key", key)] if key else [])
    try:
        reply, info = stub.Charge.with_call(request, metadata=metadata, timeout=10)
        code, trailers = grpc.StatusCode.OK, info.trailing_metadata()
    except grpc.RpcError as error:
        reply, code, trailers = None, error.code(), error.trailing_metadata()
    trailers = dict(trailers or ())
    print(f"{code.name:20} {dict(sorted(trailers.items()))}")
    return code, reply, trailers


def expect(what, ok):
    if not ok:
        print(f"unexpected: {what}", file=sys.stderr)
        sys.exit(1)


def main():
    stub = payments_pb2_grpc.PaymentsStub(grpc.insecure_channel(sys.argv[1]))
    key = str(uuid.uuid4())  # made once, sent with every retry of this charge
    order = payments_pb2.ChargeRequest(amount=4990, currency="RUB", order_id="A-10023")

    code, first, trailers = call(stub, order, key)
    expect("the first call charges", code == grpc.StatusCode.OK and first.charge_id)
    expect("it says until when the key is kept", "idempotency-expires" in trailers)

    code, again, trailers = call(stub, order, key)
    expect("a retry is a replay of the same charge",
           code == grpc.StatusCode.OK and again.charge_id == first.charge_id
           and trailers.get("idempotent-replayed") == "true")

    other = payments_pb2.ChargeRequest(amount=100, currency="RUB", order_id="A-10023")
    code, _, trailers = call(stub, other, key)
    expect("the key with another request is refused",
           code == grpc.StatusCode.FAILED_PRECONDITION
           and trailers.get("idempotency-error") == "idempotency_key_reused")

    code, _, trailers = call(stub, order, None)
    expect("a call without a key is refused",
           code == grpc.StatusCode.INVALID_ARGUMENT
           and trailers.get("idempotency-error") == "idempotency_key_required")
    print(f"one charge: {first.charge_id}")


if __name__ == "__main__":
    main()

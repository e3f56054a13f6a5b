"""An in-process gRPC server answering Ray's two token-auth probe methods as Ray's GCS does, and a token for it."""

from __future__ import annotations

from concurrent import futures

import grpc

from cluster import auth

TOKEN = "c0ffee" * 10 + "beef"


class FakeGcs:
    """A gRPC server with Ray's two probe methods, refusing calls without `Bearer <token>` like Ray's interceptor."""

    def __init__(self, token: str | None):
        self.token = token
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers([self])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def service(self, details):  # grpc.GenericRpcHandler
        if details.method not in (auth._GCS_METHOD, auth._CLIENT_METHOD):
            return None

        def answer(request, context):
            metadata = dict(context.invocation_metadata())
            if self.token and metadata.get("authorization") != f"Bearer {self.token}":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: missing or incorrect")
            return b""

        return grpc.unary_unary_rpc_method_handler(answer)

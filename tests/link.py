"""A TCP link between a worker and its database server that a test can cut, as a network partition does.

`Link` listens on a loopback port and forwards each connection to the
server.  ``freeze()`` stops forwarding in both directions without closing
anything: statements sent meanwhile get no answer and no error, exactly
what a worker on the far side of a partition sees.  ``close()`` ends it.
"""

from __future__ import annotations

import select
import socket
import threading

import sqlalchemy as sa


class Link:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._frozen = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="link-accept").start()

    def url(self, server_url: str) -> str:
        """``server_url`` pointed at this link instead of at the server."""
        return (
            sa.make_url(server_url)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )

    def freeze(self) -> None:
        """Stop forwarding: nothing more reaches either side, and nothing is closed."""
        self._frozen.set()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._frozen.is_set():
                with self._lock:
                    self._sockets.append(client)  # accepted, never answered
                continue
            server = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._forward, args=(client, server), daemon=True).start()

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        peers = {client: server, server: client}
        while not self._closed.is_set() and not self._frozen.is_set():
            try:
                readable, _, _ = select.select(list(peers), [], [], 0.05)
                for sock in readable:
                    if self._frozen.is_set():
                        break
                    data = sock.recv(65536)
                    if not data:
                        client.close()
                        server.close()
                        return
                    peers[sock].sendall(data)
            except OSError:
                return

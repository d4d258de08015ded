"""A TCP link between a worker and its database server that a test can cut, as a network partition does.

`Link` listens on a loopback port and forwards each connection to the
server.  ``freeze()`` stops forwarding in both directions without closing
anything: statements sent meanwhile get no answer and no error, exactly
what a worker on the far side of a partition sees.  ``lose_next_reply()``
lets the next statement reach the server and then cuts its connection
before the answer comes back: the client cannot tell whether it committed.
``sever()`` closes every connection and refuses new ones until
``restore()``: a server gone away, noticed at once.  ``close()`` ends it.
"""

from __future__ import annotations

import select
import socket
import threading
import time

import sqlalchemy as sa


class Link:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._frozen = threading.Event()
        self._severed = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self._lose_next_reply = False
        #: How many connections were cut after their statement reached the server.
        self.replies_lost = 0
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

    def sever(self) -> None:
        """Close every forwarded connection, and each new one as soon as it is made."""
        self._severed.set()
        with self._lock:
            for sock in self._sockets[1:]:
                sock.close()
            del self._sockets[1:]

    def restore(self) -> None:
        """Forward new connections again."""
        self._severed.clear()

    def lose_next_reply(self) -> None:
        """Forward the next statement any connection sends, then cut that connection unanswered."""
        with self._lock:
            self._lose_next_reply = True

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
            if self._severed.is_set():
                client.close()
                continue
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
        cut_at: float | None = None
        while not self._closed.is_set() and not self._frozen.is_set():
            if cut_at is not None and time.monotonic() >= cut_at:
                client.close()
                server.close()
                return
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
                    if cut_at is not None and sock is server:
                        continue  # the answer is lost
                    if sock is client and cut_at is None:
                        with self._lock:
                            doomed, self._lose_next_reply = self._lose_next_reply, False
                        if doomed:
                            self.replies_lost += 1
                            # Time for the server to run (and commit) it.
                            cut_at = time.monotonic() + 0.5
                    peers[sock].sendall(data)
            except OSError:
                return

"""A process that is not part of the run probes node 0's center server (``... center_stranger.py
ADDRESS SERVER_PID OUT_JSON``).

ADDRESS is a center's ``tcp://host:port#token#center``. In order: a frame with nothing else
(``[b"hello"]``), requests with a wrong token, requests with the right token but malformed (one
of them an ``open`` whose pickle would create a file if unpickled), then frames far larger
than the center's blocks (one with a wrong token, one with the right token, and one endless
multipart message spoken in raw ZMTP without any credentials). Each probe waits a moment for a
reply. Then one well-formed ``values`` request, whose reply must come. It writes what it saw,
and the server's peak resident memory (``VmHWM``) before and after, to OUT_JSON.
"""

import json
import os
import pickle
import socket
import struct
import sys
import time

import zmq

BIG = 128 << 20


class Evil:
    """Unpickling it creates a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def dealer(endpoint, password=None):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if password is not None:
        s.plain_username, s.plain_password = b"synk", password
    s.connect(endpoint)
    return s


def ask(endpoint, frames, password=None, wait=0.5):
    """Send ``frames`` on a fresh connection; the reply's frames, or None if none came."""
    s = dealer(endpoint, password)
    try:
        s.send_multipart(frames, copy=False)
        if s.poll(int(wait * 1000)):
            return [f.decode("latin-1")[:80] for f in s.recv_multipart()]
        return None
    finally:
        s.close()


def raw_endless_message(host, port, total, piece=1 << 20):
    """A stranger speaking ZMTP 3.0 with the NULL mechanism: greeting, READY, then frames that
    all say more follows."""
    s = socket.socket()
    try:
        s.connect((host, port))
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
        body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        s.sendall(b"\x04" + bytes([len(body)]) + body)
        frame = b"\x03" + struct.pack(">Q", piece) + b"x" * piece
        for _ in range(total // piece):
            s.sendall(frame)
        return "sent"
    except OSError as e:        # the server closed the connection: what a stranger should meet
        return f"closed: {type(e).__name__}"
    finally:
        s.close()


def main(address, server_pid, out):
    endpoint, token, name = address.split("#", 2)
    token, wrong = token.encode(), b"0" * len(token)
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    marker = out + ".unpickled"
    seen = {"hwm_before": peak_rss(server_pid)}
    seen["hello"] = ask(endpoint, [b"hello"])
    seen["wrong_password"] = ask(endpoint, [wrong, b"values"], password=wrong)
    seen["wrong_token"] = ask(endpoint, [wrong, b"values"], password=token)
    seen["wrong_token_old_format"] = ask(endpoint, [wrong, b"values", name.encode()])
    malformed = {"token_alone": [token], "unknown_op": [token, b"bogus"],
                 "short_claim": [token, b"claim", b"\1"],
                 "odd_exchange": [token, b"exchange", b"\0" * 7],
                 "values_with_junk": [token, b"values", b"junk"],
                 "open_pickle": [token, b"open", pickle.dumps(Evil(marker))],
                 "open_pickle_old_format": [token, b"open", name.encode(),
                                            pickle.dumps(Evil(marker))]}
    seen["malformed"] = {k: ask(endpoint, frames, password=token) for k, frames in malformed.items()}
    seen["unpickled"] = os.path.exists(marker)
    big = bytes(BIG)
    seen["big_wrong_token"] = ask(endpoint, [wrong, b"exchange", big], password=wrong, wait=2)
    seen["big_right_token"] = ask(endpoint, [token, b"exchange", big], password=token, wait=2)
    del big
    seen["raw_endless"] = raw_endless_message(host, int(port), BIG)
    time.sleep(1)
    seen["alive"] = os.path.exists(f"/proc/{server_pid}")
    seen["hwm_after"] = peak_rss(server_pid) if seen["alive"] else None
    seen["values"] = ask(endpoint, [token, b"values"], password=token, wait=5)
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

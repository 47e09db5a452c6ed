"""Fake `sglang_router.launch_router`: a loopback router with the documented worker API, forwarding /generate
round-robin over its workers.

The current API (`POST /workers` queued, `GET /workers`, `DELETE /workers/{url}`) by default; with
`--fake-legacy`, only the older `/add_worker?url=` and `/remove_worker?url=`. A worker that cannot be reached
gets the request retried on the next one, as the real router's retries do. Every call is recorded (--fake-record).
"""
import argparse
import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import ThreadingHTTPServer

from fake_http import JSONHandler


class FakeRouter:
    def __init__(self, args):
        self.args = args
        self.workers = list(args.worker_urls)
        self.lock = threading.Lock()
        self.turn = itertools.count()

    def record(self, path, **details):
        with self.lock, open(self.args.fake_record, "a") as log:
            log.write(json.dumps({"path": path, **details}) + "\n")

    def add(self, url):
        def register():
            time.sleep(0.2)  # the current API queues registrations: a client must wait until it is listed
            with self.lock:
                if url not in self.workers:
                    self.workers.append(url)
            self.record("add", url=url)

        if self.args.fake_legacy:
            register()
        else:
            threading.Thread(target=register, daemon=True).start()

    def remove(self, url):
        with self.lock:
            if url not in self.workers:
                return False
            self.workers.remove(url)
        self.record("remove", url=url)
        return True

    def generate(self, body: bytes):
        with self.lock:
            workers = list(self.workers)
        for attempt in range(len(workers)):
            url = workers[(next(self.turn)) % len(workers)]
            request = urllib.request.Request(url + "/generate", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    answer = response.read()
            except urllib.error.HTTPError as error:
                return error.code, error.read()
            except OSError:
                continue
            self.record("generate", worker=url)
            return 200, answer
        return 503, json.dumps({"error": f"no worker answered ({len(workers)} registered)"}).encode()


def make_handler(router):
    class Handler(JSONHandler):
        def do_GET(self):
            if self.path == "/health":
                self.reply(200)
            elif self.path == "/workers" and not router.args.fake_legacy:
                with router.lock:
                    listed = [{"url": url, "worker_type": "regular", "is_healthy": True} for url in router.workers]
                self.reply(200, json.dumps({"workers": listed, "total": len(listed)}).encode())
            else:
                self.reply(404)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            path, _, query = self.path.partition("?")
            url = urllib.parse.parse_qs(query).get("url", [None])[0]
            if path == "/generate":
                self.reply(*router.generate(body))
            elif path == "/workers" and not router.args.fake_legacy:
                payload = json.loads(body)
                if set(payload) != {"url", "worker_type"} or payload["worker_type"] != "regular":
                    self.reply(400, b'{"error": "expected {url, worker_type: regular}"}')
                    return
                router.add(payload["url"])
                self.reply(202, json.dumps({"status": "accepted", "url": payload["url"]}).encode())
            elif path == "/add_worker" and router.args.fake_legacy and url:
                router.add(url)
                self.reply(200)
            elif path == "/remove_worker" and router.args.fake_legacy and url:
                self.reply(200 if router.remove(url) else 404)
            else:
                self.reply(404)

        def do_DELETE(self):
            prefix = "/workers/"
            if self.path.startswith(prefix) and not router.args.fake_legacy:
                found = router.remove(urllib.parse.unquote(self.path[len(prefix):]))
                self.reply(202 if found else 404)
            else:
                self.reply(404)

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker-urls", nargs="*", default=[])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--fake-record", required=True)
    parser.add_argument("--fake-legacy", action="store_true")
    args = parser.parse_args()
    print(f"fake sglang router pid {os.getpid()} args {vars(args)}", flush=True)
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(FakeRouter(args)))
    httpd.daemon_threads = True
    httpd.serve_forever()


if __name__ == "__main__":
    main()

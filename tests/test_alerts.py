"""Alerts against real servers: an SMTP server (aiosmtpd) and an HTTP webhook receiver, both on
127.0.0.1, reached through Airflow connections defined in the environment."""

from __future__ import annotations

import base64
import email
import json
import logging
import threading
from email import policy
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from aiosmtpd.controller import Controller
from airflow.providers.http.notifications.http import HttpNotifier

from tests.conftest import free_port
from tidemark import config
from tidemark.airflow import alerts
from tidemark.core.errors import ConfigError

WAIT = 30  # seconds to wait for a delivery event (never a fixed sleep)
PIPELINE = "flights"
RUN_ID = "manual__2026-11-22T03:00:00+00:00"
SECRET = "s3cret-pw"
DSN = f"postgresql://tidemark:{SECRET}@db.internal:5432/ledger"
ERROR = f"cannot connect to sink main ({DSN}): connection refused"

_BASE = (
    "source: {type: postgres_log, dsn: x, table: t}\ndecode: {schema: {a: int}}\n"
    "sinks: [{name: s, dsn: x, table: t, key: [a]}]\n"
)


# -- servers -------------------------------------------------------------------------------------


class _Mailbox:
    def __init__(self):
        self.messages: list[email.message.EmailMessage] = []
        self.envelopes = []
        self.arrived = threading.Event()

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's name
        self.envelopes.append(envelope)
        self.messages.append(email.message_from_bytes(envelope.content, policy=policy.default))
        self.arrived.set()
        return "250 OK"


@pytest.fixture
def smtp(monkeypatch):
    box = _Mailbox()
    port = free_port()
    ctl = Controller(box, hostname="127.0.0.1", port=port)
    ctl.start()
    monkeypatch.setenv(
        "AIRFLOW_CONN_SMTP_DEFAULT",
        json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": port,
                "extra": {
                    "disable_ssl": True,
                    "disable_tls": True,
                    "from_email": "tidemark@localhost",
                    "retry_limit": 0,
                    "timeout": 10,
                },
            }
        ),
    )
    yield box
    ctl.stop()


class _Receiver:
    def __init__(self):
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.headers: list[dict] = []
        self.status = 200
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.paths.append(self.path)
                receiver.headers.append(dict(self.headers))
                receiver.bodies.append(json.loads(raw))
                self.send_response(receiver.status)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok" if receiver.status == 200 else b"boom")
                receiver.arrived.set()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(WAIT)


@pytest.fixture
def webhook(monkeypatch):
    rec = _Receiver()
    monkeypatch.setenv(
        "AIRFLOW_CONN_TIDEMARK_WEBHOOK",
        json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{rec.port}/hook"}),
    )
    yield rec
    rec.close()


# -- context -------------------------------------------------------------------------------------


def failure_context(exception=None, with_log_url=True):
    """What Airflow passes to an on_failure_callback (the parts the alert reads)."""
    ti = SimpleNamespace(
        dag_id="tidemark_flights", task_id="replay", run_id=RUN_ID, try_number=2, map_index=-1
    )
    if with_log_url:
        ti.log_url = (
            f"http://airflow.example:8080/dags/tidemark_flights/runs/{RUN_ID}"
            f"/tasks/replay?try_number=2"
        )
    from airflow.sdk import DAG

    return {
        "dag": DAG("tidemark_flights", schedule=None),
        "task": SimpleNamespace(task_id="replay"),
        "ti": ti,
        "task_instance": ti,
        "run_id": RUN_ID,
        "dag_run": SimpleNamespace(run_id=RUN_ID),
        "exception": exception
        if exception is not None
        else RuntimeError(ERROR + "\nTraceback (most recent call last):\n  more lines"),
    }


def pipeline(alerts_yaml: str = "") -> config.Pipeline:
    return config.parse(_BASE + alerts_yaml, "flights.yaml", default_name=PIPELINE)


ALERTS = (
    "alerts:\n  email: [ops@example.com, dba@example.com]\n  webhook_conn_id: tidemark_webhook\n"
)


def alert_errors(capfd, caplog) -> list[str]:
    """The "alert not sent" lines, wherever Airflow's logging sent them (structlog writes to
    the console, stdlib logging reaches caplog)."""
    out, err = capfd.readouterr()
    text = "\n".join([out, err, *(r.getMessage() for r in caplog.records)])
    assert "tok3n" not in text and "secret-token" not in text, text  # nothing logs the path
    return [ln for ln in text.splitlines() if "alert not sent" in ln]


def html_body(msg) -> str:
    part = msg.get_body(preferencelist=("html", "plain"))
    return part.get_content()


# -- failure alerts ------------------------------------------------------------------------------


def test_failed_task_is_mailed_with_the_facts_and_links(smtp, monkeypatch):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.example:8080/")
    p = pipeline(ALERTS)
    notifiers = alerts.failure_notifiers(p)
    mail = next(n for n in notifiers if isinstance(n, alerts.EmailAlert))
    mail(failure_context())  # how Airflow calls a notifier
    assert smtp.arrived.wait(WAIT), "no mail arrived"
    msg = smtp.messages[0]
    assert msg["Subject"] == f"[tidemark] flights: task replay failed (run {RUN_ID})"
    assert msg["From"] == "tidemark@localhost"
    assert sorted(smtp.envelopes[0].rcpt_tos) == ["dba@example.com", "ops@example.com"]
    body = html_body(msg)
    masked = ERROR.replace(SECRET, "***")
    assert f"error: RuntimeError: {masked}" in body
    assert SECRET not in body and "Traceback" not in body
    log_url = f"http://airflow.example:8080/dags/tidemark_flights/runs/{RUN_ID}/tasks/replay"
    assert f'<a href="{log_url}?try_number=2">' in body
    assert '<a href="http://airflow.example:8080/tidemark/dlq/?pipeline=flights">' in body
    for fact in (
        "pipeline: flights",
        "dag: tidemark_flights",
        "task: replay",
        f"run: {RUN_ID}",
        "try: 2",
    ):
        assert fact in body


def test_failed_task_is_posted_to_the_webhook(webhook, monkeypatch):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.example:8080")
    p = pipeline("alerts: {webhook_conn_id: tidemark_webhook}\n")
    [hook] = alerts.failure_notifiers(p)
    assert isinstance(hook, alerts.WebhookNotifier) and isinstance(hook, HttpNotifier)
    hook(failure_context(with_log_url=False))
    assert webhook.arrived.wait(WAIT), "no webhook call arrived"
    assert webhook.paths == ["/hook"]
    [payload] = webhook.bodies
    assert list(payload) == ["text"]
    text = payload["text"]
    assert text.startswith(f"[tidemark] flights: task replay failed (run {RUN_ID})\n")
    assert f"error: RuntimeError: {ERROR.replace(SECRET, '***')}" in text
    assert SECRET not in text
    # no ti.log_url: the link is built from AIRFLOW__API__BASE_URL, run id quoted
    assert (
        "log: http://airflow.example:8080/dags/tidemark_flights/runs/"
        "manual__2026-11-22T03%3A00%3A00%2B00%3A00/tasks/replay?try_number=2"
    ) in text
    assert "dead-letter queue: http://airflow.example:8080/tidemark/dlq/?pipeline=flights" in text


def test_the_webhook_goes_through_the_http_providers_hook(webhook, monkeypatch):
    """HttpHook's connection handling applies: a login is basic auth, extra headers are sent."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_TIDEMARK_WEBHOOK",
        json.dumps(
            {
                "conn_type": "http",
                "host": f"http://127.0.0.1:{webhook.port}/hook",
                "login": "bot",
                "password": "pa55word",
                "extra": {"X-Team": "data"},
            }
        ),
    )
    alerts.WebhookNotifier("tidemark_webhook", PIPELINE).post("hello")
    assert webhook.paths == ["/hook"] and webhook.bodies == [{"text": "hello"}]
    headers = webhook.headers[0]
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"bot:pa55word").decode()
    assert headers["X-Team"] == "data" and headers["Content-Type"] == "application/json"


def test_a_failing_webhook_is_logged_masked_and_never_raises(webhook, monkeypatch, caplog, capfd):
    monkeypatch.setenv(
        "AIRFLOW_CONN_TIDEMARK_WEBHOOK",
        json.dumps(
            {"conn_type": "http", "host": f"http://127.0.0.1:{webhook.port}/services/T0/B0/tok3n"}
        ),
    )
    webhook.status = 500
    hook = alerts.WebhookNotifier("tidemark_webhook", PIPELINE)
    with caplog.at_level(logging.DEBUG):
        hook(failure_context())  # must not raise
    assert webhook.arrived.wait(WAIT)
    assert webhook.paths == ["/services/T0/B0/tok3n"]
    lines = alert_errors(capfd, caplog)
    assert len(lines) == 1, lines
    assert f"http://127.0.0.1:{webhook.port} " in lines[0] and "HTTP 500" in lines[0]
    assert "tok3n" not in lines[0] and "/services" not in lines[0]


def test_an_unreachable_webhook_and_smtp_server_never_raise(monkeypatch, caplog, capfd):
    dead = free_port()
    monkeypatch.setenv(
        "AIRFLOW_CONN_TIDEMARK_WEBHOOK",
        json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{dead}/hook/secret-token"}),
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_SMTP_DEFAULT",
        json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": dead,
                "extra": {
                    "disable_ssl": True,
                    "disable_tls": True,
                    "from_email": "tm@localhost",
                    "retry_limit": 0,
                    "timeout": 5,
                },
            }
        ),
    )
    with caplog.at_level(logging.DEBUG):
        for n in alerts.failure_notifiers(pipeline(ALERTS)):
            n(failure_context())
    lines = alert_errors(capfd, caplog)
    assert len(lines) == 2, lines
    assert "e-mail via connection smtp_default" in lines[0] and "Connection refused" in lines[0]
    assert f"webhook http://127.0.0.1:{dead} " in lines[1]
    assert "secret-token" not in " ".join(lines)


def test_send_uses_both_channels(smtp, webhook):
    p = pipeline(ALERTS)
    got = alerts.send(p, "DLQ holds 12001 quarantined rows\n(max 10000)", "see the DLQ page")
    assert got == ["email", "webhook"]
    assert smtp.arrived.wait(WAIT) and webhook.arrived.wait(WAIT)
    subject = "[tidemark] flights: DLQ holds 12001 quarantined rows (max 10000)"
    assert smtp.messages[0]["Subject"] == subject
    assert "see the DLQ page" in html_body(smtp.messages[0])
    assert webhook.bodies == [{"text": f"{subject}\nsee the DLQ page"}]


def test_no_alert_settings_means_no_notifiers():
    assert alerts.failure_notifiers(pipeline()) == []
    assert alerts.send(pipeline(), "x", "y") == []


# -- text ----------------------------------------------------------------------------------------


def test_error_line_is_one_masked_clamped_line():
    long = RuntimeError("x" * 1000)
    assert len(alerts.error_line(long)) == alerts.ERROR_MAX_CHARS
    assert alerts.error_line("\n\n  first\nsecond") == "first"
    assert alerts.error_line(None) == "(no error recorded)"
    assert alerts.error_line(KeyError()) == "KeyError"
    # a DSN beyond the clamp point is masked before clamping
    text = alerts.error_line(ValueError("y" * 280 + f" {DSN}"))
    assert SECRET not in text
    # secrets Airflow's masker knows (connection passwords a task fetched) are masked too
    from airflow.sdk.log import mask_secret

    mask_secret("hunter2-registered")
    assert alerts.error_line(RuntimeError("login with hunter2-registered refused")) == (
        "RuntimeError: login with *** refused"
    )
    # Jinja-looking text is sent verbatim
    assert alerts.error_line(ValueError("bad {{ x }}")) == "ValueError: bad {{ x }}"


def test_mapped_task_and_default_base_url(monkeypatch):
    monkeypatch.delenv("AIRFLOW__API__BASE_URL", raising=False)
    ctx = failure_context(with_log_url=False)
    ctx["ti"].map_index = 3
    subject, body = alerts.alert_text(ctx, PIPELINE)
    assert "task: replay[3]" in body
    assert "/tasks/replay/mapped/3?try_number=2" in body
    assert alerts.DLQ_PATH == "/tidemark/dlq/"
    assert f"{alerts.base_url()}/tidemark/dlq/?pipeline=flights" in body


@pytest.mark.parametrize(
    "conn,url",
    [
        (
            {"conn_type": "http", "host": "https://hooks.slack.com/services/T0/B0/XX"},
            "https://hooks.slack.com/services/T0/B0/XX",
        ),
        (
            {
                "conn_type": "http",
                "host": "https://hooks.slack.com",
                "password": "services/T0/B0/XX",
            },
            "https://hooks.slack.com/services/T0/B0/XX",
        ),
        (
            {"conn_type": "http", "host": "https://chat.example/hooks/abc", "password": "ignored"},
            "https://chat.example/hooks/abc",
        ),
        (
            {
                "conn_type": "http",
                "host": "chat.example",
                "schema": "http",
                "port": 8065,
                "password": "hooks/abc",
            },
            "http://chat.example:8065/hooks/abc",
        ),
        ({"conn_type": "http", "host": "chat.example/hooks/abc"}, "http://chat.example/hooks/abc"),
        (
            {"conn_type": "http", "host": "chat.example/hooks/abc", "schema": "https"},
            "https://chat.example/hooks/abc",
        ),
        (
            {"conn_type": "generic", "host": "chat.example/hooks/abc"},
            "https://chat.example/hooks/abc",
        ),
    ],
)
def test_webhook_url_forms(conn, url):
    c = SimpleNamespace(**{"schema": None, "port": None, "password": None, **conn})
    assert alerts.webhook_url(c) == url


def test_webhook_url_from_a_uri_connection(monkeypatch):
    from airflow.sdk import BaseHook

    monkeypatch.setenv("AIRFLOW_CONN_TM_URI_HOOK", "https://hooks.slack.com/services/T0/B0/XX")
    conn = BaseHook.get_connection("tm_uri_hook")
    assert alerts.webhook_url(conn) == "https://hooks.slack.com/services/T0/B0/XX"


# -- configuration -------------------------------------------------------------------------------


def test_alerts_defaults_and_values():
    a = pipeline().alerts
    assert (a.email, a.smtp_conn_id, a.webhook_conn_id, a.dlq_max, a.prepared_max_age_minutes) == (
        [],
        "smtp_default",
        None,
        10_000,
        30,
    )
    b = pipeline(
        "alerts:\n  email: ops@example.com\n  dlq_max: 5\n"
        "  prepared_max_age_minutes: 10\n  smtp_conn_id: mail\n"
    ).alerts
    assert (b.email, b.dlq_max, b.prepared_max_age_minutes, b.smtp_conn_id) == (
        ["ops@example.com"],
        5,
        10,
        "mail",
    )


@pytest.mark.parametrize(
    "section,field,problem",
    [
        (
            "alerts: {email: [ops@example.com, opsexample.com]}",
            "alerts.email",
            "'opsexample.com' is not an e-mail address (expected name@domain)",
        ),
        ("alerts: {email: ['a@b@c']}", "alerts.email", "'a@b@c' is not an e-mail address"),
        ("alerts: {emails: [ops@example.com]}", "alerts.emails", "Extra inputs are not permitted"),
        ("alerts: {dlq_max: -1}", "alerts.dlq_max", "Input should be greater than or equal to 0"),
        (
            "alerts: {prepared_max_age_minutes: 0}",
            "alerts.prepared_max_age_minutes",
            "Input should be greater than 0",
        ),
    ],
)
def test_bad_alerts_name_the_file_the_field_and_the_problem(section, field, problem):
    with pytest.raises(ConfigError) as exc:
        pipeline(section + "\n")
    assert exc.value.where == "flights.yaml"
    assert exc.value.field == field
    assert problem in exc.value.problem
    assert str(exc.value).startswith(f"flights.yaml: {field}: ")

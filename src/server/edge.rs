//! The HTTP edge of every listener: connection slots, the header-read and request timeouts,
//! and graceful shutdown. See ARCHITECTURE "The HTTP edge: what a connection may cost".

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::task::Context;
use std::task::Poll;
use std::time::Duration;
use std::time::Instant;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse;
use axum::response::Response;
use hyper_util::rt::TokioIo;
use hyper_util::rt::TokioTimer;
use modelforge_proto::api::ErrorCode;
use tokio::io::AsyncRead;
use tokio::io::AsyncWrite;
use tokio::io::ReadBuf;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::Semaphore;

use super::Shutdown;
use crate::error::ApiError;
use crate::tls::ConnPeer;

/// How long open connections may finish their request in flight at shutdown.
const DRAIN: Duration = Duration::from_secs(10);

/// The default connection limit: the open-file limit (raised to its hard limit first) less
/// 1,024 descriptors kept for the data files, peer connections and the agent-facing
/// clients, and at least 256. Accepting beyond the descriptors the process has would stall
/// every accept on EMFILE; refusing at accept keeps the member serving the connections it has.
pub fn default_max_connections() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    let soft = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 4096;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        lim.rlim_cur
    };
    (soft.min(1 << 20) as usize).saturating_sub(1024).max(256)
}

/// The connection slots of one listener.
pub struct Slots {
    sem: Arc<Semaphore>,
    max: usize,
    last_warned: std::sync::Mutex<Option<Instant>>,
}

impl Slots {
    pub fn new(max: usize) -> Arc<Self> {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        Arc::new(Slots {
            sem: Arc::new(Semaphore::new(max)),
            max,
            last_warned: Default::default(),
        })
    }

    /// No limit (tools and benchmarks that serve our stack).
    pub fn unlimited() -> Arc<Self> {
        Self::new(Semaphore::MAX_PERMITS)
    }

    /// A slot for a new connection, or None (and a warning at most once a second) when all
    /// are taken: the caller closes the connection.
    pub fn take(&self) -> Option<OwnedSemaphorePermit> {
        match self.sem.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                let mut last = self.last_warned.lock().unwrap_or_else(|p| p.into_inner());
                if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    *last = Some(Instant::now());
                    tracing::warn!(
                        max_connections = self.max,
                        "connection limit reached: closing new connections (--max-connections)"
                    );
                }
                None
            }
        }
    }

    /// Connections open now.
    pub fn in_use(&self) -> usize {
        self.max - self.sem.available_permits()
    }
}

/// A connection's IO holding its slot: the slot is free again when the connection is dropped.
pub struct Held<T> {
    io: T,
    _slot: OwnedSemaphorePermit,
}

impl<T> Held<T> {
    pub fn new(io: T, slot: OwnedSemaphorePermit) -> Self {
        Held { io, _slot: slot }
    }

    pub fn get_ref(&self) -> &T {
        &self.io
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Held<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Held<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Accept the next TCP connection that gets a slot (others are closed at once). An accept
/// error (out of descriptors and the like) backs off instead of spinning.
pub async fn accept_held(
    listener: &tokio::net::TcpListener,
    slots: &Slots,
) -> (Held<TcpStream>, std::net::SocketAddr) {
    loop {
        match listener.accept().await {
            Ok((tcp, addr)) => {
                let _ = tcp.set_nodelay(true);
                if let Some(slot) = slots.take() {
                    return (Held::new(tcp, slot), addr);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A plain-TCP listener (`--insecure-http`) with connection slots.
pub struct PlainListener {
    listener: tokio::net::TcpListener,
    slots: Arc<Slots>,
}

impl PlainListener {
    pub fn new(listener: tokio::net::TcpListener, slots: Arc<Slots>) -> Self {
        PlainListener { listener, slots }
    }
}

impl axum::serve::Listener for PlainListener {
    type Io = Held<TcpStream>;
    type Addr = ConnPeer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, remote) = accept_held(&self.listener, &self.slots).await;
        (
            io,
            ConnPeer {
                remote,
                member: None,
            },
        )
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(ConnPeer {
            remote: self.listener.local_addr()?,
            member: None,
        })
    }
}

/// Serve `app` on `listener` until `stop`: HTTP/1.1 with hyper's timer, so that a connection
/// that has not sent a complete request head within `header_read_timeout` is closed. Every
/// request carries its connection's [`ConnPeer`] (axum `ConnectInfo`).
pub async fn serve<L>(mut listener: L, app: Router, stop: Shutdown, header_read_timeout: Duration)
where
    L: axum::serve::Listener<Addr = ConnPeer>,
{
    let (close_tx, close_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let (io, peer) = tokio::select! {
            c = listener.accept() => c,
            _ = stop.triggered() => break,
        };
        while conns.try_join_next().is_some() {}
        let app = app.clone();
        let mut close = close_rx.clone();
        conns.spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let mut req = req.map(axum::body::Body::new);
                    req.extensions_mut().insert(ConnectInfo(peer.clone()));
                    let app = app.clone();
                    async move {
                        let resp = tower::ServiceExt::oneshot(app, req)
                            .await
                            .unwrap_or_else(|e: Infallible| match e {});
                        Ok::<_, Infallible>(resp)
                    }
                });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .serve_connection(TokioIo::new(io), svc);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = async { close.wait_for(|c| *c).await.map(|_| ()) } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    // Stop accepting (the port closes), let requests in flight finish, then drop the rest.
    drop(listener);
    let _ = close_tx.send(true);
    let drained =
        tokio::time::timeout(DRAIN, async { while conns.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::info!(
            open = conns.len(),
            "connections still open after the drain: closing them"
        );
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
}

/// How long an agent request's body may take to arrive before it is processed.
pub const AGENT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

tokio::task_local! {
    /// The admission slot of the agent request this task serves, while it holds one.
    static ADMITTED: std::sync::Mutex<Option<tokio::sync::OwnedSemaphorePermit>>;
}

/// Give back the admission slot of the agent request this task serves, if it holds one (a
/// no-op elsewhere). Called before waiting on a bounded queue of its own (an argon2
/// verification, a replicated write): a slot bounds the CPU work in progress, and a burst
/// of first heartbeats waiting for their write must not shed the heartbeats behind them.
pub fn leave_admission() {
    let _ = ADMITTED.try_with(|slot| slot.lock().unwrap_or_else(|p| p.into_inner()).take());
}

/// How long a shed agent is told to stay away (`Retry-After`): one second at first, doubled
/// at the end of every second in which more than a tenth of the agent requests were shed,
/// held through a second with fewer sheds, halved for every second in which none were, never
/// more than `cap_s`. (Doubling on any shed drove the level to its cap from a handful of
/// queue-delay sheds at saturation, and the next agents shed, even once, stayed away that
/// long: a flood right after measuring capacity admitted a few hundred per second.) Agents wait that long plus up to as long again,
/// so a fleet that keeps offering more than the member serves is spread over a growing window
/// until what it offers fits, instead of the member spending its CPU answering 503s (a shed
/// request costs about two thirds of an admitted heartbeat: the transport, not the handler,
/// is the cost). The cap keeps a shed node's silence well inside `--stale-after`.
pub struct ShedBackoff {
    origin: Instant,
    /// Milliseconds from `origin` at which the current one-second window began.
    window_ms: AtomicU64,
    shed_in_window: AtomicU64,
    admitted_in_window: AtomicU64,
    after_s: AtomicU64,
    cap_s: u64,
}

impl ShedBackoff {
    pub fn new(cap_s: u64) -> Self {
        Self {
            origin: Instant::now(),
            window_ms: AtomicU64::new(0),
            shed_in_window: AtomicU64::new(0),
            admitted_in_window: AtomicU64::new(0),
            after_s: AtomicU64::new(1),
            cap_s: cap_s.max(1),
        }
    }

    /// `n` agent requests were shed (one, or a relayed batch's items): count them; the
    /// `Retry-After` to answer, in seconds.
    pub fn shed(&self, n: u64) -> u64 {
        self.roll(self.now_ms());
        self.shed_in_window.fetch_add(n, Ordering::Relaxed);
        self.after_s.load(Ordering::Relaxed)
    }

    /// `n` agent requests were admitted: count them (and move the window on when a second
    /// has passed). Items, not batches, so that the shed share is a share of requests.
    pub fn admitted(&self, n: u64) {
        self.roll(self.now_ms());
        self.admitted_in_window.fetch_add(n, Ordering::Relaxed);
    }

    /// The `Retry-After` a request shed now would get.
    pub fn current(&self) -> u64 {
        self.roll(self.now_ms());
        self.after_s.load(Ordering::Relaxed)
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// End the window if a second has passed: one caller wins the exchange and moves the
    /// level; requests counted by others meanwhile fall into the next window.
    fn roll(&self, now_ms: u64) {
        let began = self.window_ms.load(Ordering::Relaxed);
        let seconds = now_ms.saturating_sub(began) / 1000;
        if seconds == 0
            || self
                .window_ms
                .compare_exchange(began, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let shed = self.shed_in_window.swap(0, Ordering::Relaxed);
        let admitted = self.admitted_in_window.swap(0, Ordering::Relaxed);
        let level = self.after_s.load(Ordering::Relaxed);
        // The seconds after the window (if it is older than one second) passed without a
        // request at all.
        let quiet = (seconds - 1).min(63);
        let next = if shed.saturating_mul(10) > shed.saturating_add(admitted) {
            // More than a tenth shed: the fleet offers more than fits; spread it wider.
            (level.saturating_mul(2).min(self.cap_s) >> quiet).max(1)
        } else if shed > 0 {
            (level >> quiet).max(1)
        } else {
            (level >> seconds.min(63)).max(1)
        };
        self.after_s.store(next, Ordering::Relaxed);
    }
}

/// How long a request that is ready waits for the runtime: the queue that admission slots
/// cannot see. A heartbeat costs little in its handler; under overload its bytes wait in the
/// socket buffers and its connection's task waits in the runtime's run queue, so slots stay
/// free while latency grows. A probe task sleeps [`QueueDelay::PROBE`] in a loop and records
/// how late the runtime woke it, which is what a connection woken by its socket waits too.
/// The member is over its target while the last probe woke later than the target, or while
/// the probe now due is already later than it (so a sudden flood is seen as soon as the
/// queue is that long, not when the probe finally runs), or while the runtime's shared queue
/// of ready tasks is deep (see [`QueueDelay::INJECTED_READY_MAX`]). A target of zero turns
/// it off.
pub struct QueueDelay {
    origin: Instant,
    target_us: u64,
    /// How late the last probe woke, in microseconds.
    late_us: AtomicU64,
    /// When the probe sleeping now is due, in microseconds from `origin`.
    due_us: AtomicU64,
}

impl QueueDelay {
    pub const PROBE: Duration = Duration::from_millis(5);
    /// Ready tasks in the runtime's shared queue beyond which the member is over target
    /// whatever the probe says. A worker queues what becomes ready in a local queue of 256
    /// tasks; what overflows goes to the shared queue, which a busy worker takes from only
    /// once every 31 tasks, so those connections wait far longer than the probe (which sits in
    /// a local queue). Measured (docs/performance-log.md, 2026-12-05): at a flood's onset the
    /// probe alone let the admitted p99 reach 60-67 ms; with this, 19 ms.
    const INJECTED_READY_MAX: usize = 64;

    pub fn new(target: Duration) -> Self {
        Self {
            origin: Instant::now(),
            target_us: target.as_micros() as u64,
            late_us: AtomicU64::new(0),
            due_us: AtomicU64::new(u64::MAX),
        }
    }

    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }

    /// Is a request that is ready now waiting longer than the target?
    pub fn over_target(&self) -> bool {
        self.target_us > 0
            && (self.late_us.load(Ordering::Relaxed) > self.target_us
                || self
                    .now_us()
                    .saturating_sub(self.due_us.load(Ordering::Relaxed))
                    > self.target_us
                || tokio::runtime::Handle::try_current()
                    .is_ok_and(|rt| rt.metrics().global_queue_depth() > Self::INJECTED_READY_MAX))
    }

    /// The queue delay measured last, in milliseconds (the probe now overdue, if later).
    pub fn current_ms(&self) -> f64 {
        let overdue = self
            .now_us()
            .saturating_sub(self.due_us.load(Ordering::Relaxed));
        self.late_us.load(Ordering::Relaxed).max(overdue) as f64 / 1000.0
    }

    /// The probe: runs until the member stops.
    pub async fn probe(self: Arc<Self>) {
        loop {
            let due = self.now_us() + Self::PROBE.as_micros() as u64;
            self.due_us.store(due, Ordering::Relaxed);
            tokio::time::sleep(Self::PROBE).await;
            let late = self.now_us().saturating_sub(due);
            // The timer wheel rounds a sleep up to its next millisecond: not queueing.
            self.late_us
                .store(late.saturating_sub(1_000), Ordering::Relaxed);
        }
    }
}

/// Admission control of agent requests (heartbeats, inventory, smoke reports) on the member
/// that processes them: the body is read first (bounded in size and time, holding no slot, so
/// slow bodies cannot take slots from others), then a slot is taken without waiting; with none
/// free, or while ready requests wait longer than the queue-delay target ([`QueueDelay`]),
/// the request is shed at once with 503 `over_capacity` and a `Retry-After` that grows
/// while shedding goes on ([`ShedBackoff`]), costing no
/// JSON parse, no secret check and no write. The slot is held while the request works on the
/// CPU, and given back before it waits on the argon2 pool or a replicated write (both bounded
/// on their own; see [`leave_admission`]). Work in progress and the wait before it stay
/// bounded, so the latency of the requests admitted stays bounded under any offered load.
pub async fn admit_agent(
    axum::extract::State(ctx): axum::extract::State<super::Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let limit = ctx.cfg.max_body_bytes;
    let bytes =
        match tokio::time::timeout(AGENT_BODY_TIMEOUT, axum::body::to_bytes(body, limit)).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => return ApiError::too_large().into_response(),
            Err(_) => return ApiError::of(ErrorCode::RequestTimeout).into_response(),
        };
    let slot = match ctx.agent_slots.clone().try_acquire_owned() {
        Ok(slot) if !ctx.queue_delay.over_target() => Some(slot),
        _ => None,
    };
    let Some(slot) = slot else {
        ctx.checks
            .shed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return ApiError::over_capacity(ctx.shed_backoff.shed(1)).into_response();
    };
    ctx.shed_backoff.admitted(1);
    let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
    ADMITTED
        .scope(std::sync::Mutex::new(Some(slot)), next.run(req))
        .await
}

/// The request deadline: a request not answered within `--request-timeout` (60 s by default;
/// its body read included) gets 503, and its connection is closed: `request_timeout` for a read, and
/// `outcome_unknown` for anything else (it may have been proposed before its handler was cut
/// off; a retry with the same Idempotency-Key is safe).
pub async fn request_deadline(
    axum::extract::State(ctx): axum::extract::State<super::Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let read = req.method() == axum::http::Method::GET;
    // A blocking query is given its wait on top of the usual deadline.
    let limit =
        ctx.cfg.request_timeout + super::watch::blocking_time(req.method(), req.uri().query());
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => {
            let err = if read {
                ApiError::of(ErrorCode::RequestTimeout)
            } else {
                ApiError::outcome_unknown(
                    "the request was not answered in time; it may or may not have applied (retry with the same Idempotency-Key)",
                )
            };
            let mut resp = err.into_response();
            resp.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            resp
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::QueueDelay;
    use super::ShedBackoff;

    /// Wait (up to 10 s) until `f` holds.
    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_runtime_kept_from_its_ready_tasks_is_over_the_queue_delay_target_until_it_runs_them()
    {
        let q = Arc::new(QueueDelay::new(Duration::from_millis(5)));
        let probe = tokio::spawn(q.clone().probe());
        let armed = || q.due_us.load(std::sync::atomic::Ordering::Relaxed) != u64::MAX;
        until("the probe sleeps, on time", || armed() && !q.over_target()).await;
        // The runtime's only thread busy for 40 ms: the probe is overdue at once, before it
        // runs again (the onset of a flood is seen while the flood is still queued).
        std::thread::sleep(Duration::from_millis(40));
        assert!(q.over_target(), "queue delay {} ms", q.current_ms());
        assert!(q.current_ms() >= 30.0, "queue delay {} ms", q.current_ms());
        until("the probe catches up", || !q.over_target()).await;
        // Off: never over, however late.
        let off = QueueDelay::new(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!off.over_target());
        probe.abort();
    }

    /// A second with a few sheds among many admitted requests holds the level (neither
    /// doubled nor halved); past a tenth shed it doubles.
    #[test]
    fn retry_after_holds_through_a_few_sheds_and_doubles_past_a_tenth() {
        let b = ShedBackoff::new(7);
        let level = |b: &ShedBackoff| b.after_s.load(std::sync::atomic::Ordering::Relaxed);
        let window = |b: &ShedBackoff, shed: u64, admitted: u64, at_ms: u64| {
            b.shed_in_window
                .store(shed, std::sync::atomic::Ordering::Relaxed);
            b.admitted_in_window
                .store(admitted, std::sync::atomic::Ordering::Relaxed);
            b.roll(at_ms);
        };
        window(&b, 100, 1_000, 1_000);
        assert_eq!(level(&b), 1, "a tenth or less shed does not double");
        window(&b, 120, 1_000, 2_000);
        assert_eq!(level(&b), 2, "more than a tenth doubles");
        window(&b, 5, 20_000, 3_000);
        assert_eq!(level(&b), 2, "a few sheds hold the level");
        window(&b, 0, 20_000, 4_000);
        assert_eq!(level(&b), 1, "none halves it");
        // Counted through the public calls, by items (a relayed batch counts its heartbeats).
        let b = ShedBackoff::new(7);
        b.admitted(1);
        b.admitted(512);
        b.shed(1);
        b.shed(64);
        assert_eq!(
            b.admitted_in_window
                .load(std::sync::atomic::Ordering::Relaxed),
            513
        );
        assert_eq!(
            b.shed_in_window.load(std::sync::atomic::Ordering::Relaxed),
            65
        );
    }

    #[test]
    fn retry_after_doubles_while_shedding_goes_on_and_halves_when_it_stops() {
        let b = ShedBackoff::new(7);
        let level = |b: &ShedBackoff| b.after_s.load(std::sync::atomic::Ordering::Relaxed);
        b.shed_in_window
            .store(3, std::sync::atomic::Ordering::Relaxed);
        b.roll(999);
        assert_eq!(level(&b), 1, "a window ends only after a second");
        for (t, want) in [(1_000, 2), (2_000, 4), (3_000, 7), (4_000, 7)] {
            b.shed_in_window
                .store(1, std::sync::atomic::Ordering::Relaxed);
            b.roll(t);
            assert_eq!(level(&b), want, "at {t} ms");
        }
        b.roll(5_000);
        assert_eq!(level(&b), 3, "a second without shedding halves it");
        b.roll(7_500);
        assert_eq!(
            level(&b),
            1,
            "two quiet seconds halve it twice, never below one"
        );
        // Shedding in a window followed by silence: doubled for the window, halved after.
        b.shed_in_window
            .store(5, std::sync::atomic::Ordering::Relaxed);
        b.roll(8_500);
        assert_eq!(level(&b), 2);
        b.shed_in_window
            .store(5, std::sync::atomic::Ordering::Relaxed);
        b.roll(11_500);
        assert_eq!(
            level(&b),
            1,
            "4, then halved for the two silent seconds after"
        );
    }
}

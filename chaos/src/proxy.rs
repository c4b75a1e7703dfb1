//! A fault-injecting TCP proxy for one directed peer link (member i -> member j). Blocking it
//! severs every open connection and refuses new ones: a real cut of that link.

use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio::sync::watch;

pub struct Proxy {
    pub port: u16,
    blocked: watch::Sender<bool>,
}

impl Proxy {
    /// Listen on a free loopback port and forward to `127.0.0.1:target_port`.
    pub async fn start(target_port: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                if *rx.borrow() {
                    drop(inbound);
                    continue;
                }
                let mut rx = rx.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target_port)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = rx.wait_for(|b| *b) => {}
                    }
                });
            }
        });
        Ok(Self { port, blocked: tx })
    }

    pub fn set_blocked(&self, blocked: bool) {
        self.blocked.send_replace(blocked);
    }
}

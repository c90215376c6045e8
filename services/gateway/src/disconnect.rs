//! Noticing that a synchronous client went away. actix-web keeps running a handler after the
//! peer closed an HTTP/1 connection (a half-closed socket is legal), so the handler itself
//! watches: every connection keeps a duplicate of its socket (`on_connect`), and
//! [`closed`] peeks at it until it reads end-of-file, as Go's net/http does to cancel a
//! request's context.
use std::any::Any;
use std::time::Duration;

use actix_web::dev::Extensions;
use actix_web::HttpRequest;

/// How often a waiting handler checks its connection.
const POLL: Duration = Duration::from_millis(200);

/// A duplicate of the connection's socket (same open file, so non-blocking like the original;
/// closed with the connection's extensions).
struct PeerSocket(std::net::TcpStream);

/// `HttpServer::on_connect` callback: remember a duplicate of plain TCP connections' sockets.
pub fn on_connect(conn: &dyn Any, ext: &mut Extensions) {
    #[cfg(unix)]
    if let Some(stream) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
        use std::os::fd::AsFd;
        match stream.as_fd().try_clone_to_owned() {
            Ok(fd) => {
                ext.insert(PeerSocket(std::net::TcpStream::from(fd)));
            }
            Err(err) => tracing::debug!(error = %err, "cannot watch this connection"),
        }
    }
    #[cfg(not(unix))]
    let _ = (conn, ext);
}

/// Whether the peer has closed the connection: a peek reads end-of-file (or the socket
/// failed). Pending bytes (a pipelined request) or none yet mean it is still there.
fn peer_closed(socket: &std::net::TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match socket.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => false,
        Err(_) => true,
    }
}

/// Resolves once `req`'s client has gone away; never, when its connection cannot be watched.
pub async fn closed(req: &HttpRequest) {
    let Some(PeerSocket(socket)) = req.conn_data::<PeerSocket>() else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(POLL).await;
        if peer_closed(socket) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_peek_tells_a_closed_peer_from_a_quiet_or_busy_one() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        assert!(!peer_closed(&server), "quiet peer");
        client.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!peer_closed(&server), "peer with pending bytes");
        drop(client);
        std::thread::sleep(Duration::from_millis(50));
        // Pending bytes come first; the server has not read them, so drain and look again.
        let mut buf = [0u8; 64];
        let _ = std::io::Read::read(&mut &server, &mut buf);
        assert!(peer_closed(&server), "closed peer");
    }
}

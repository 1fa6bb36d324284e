//! The host socket's plumbing, shared by the donor (which listens) and the
//! node (which connects): a `SOCK_SEQPACKET` Unix socket whose packets are
//! one JSON message each, at most [`MAX_MESSAGE`] bytes, optionally with
//! one descriptor attached (`SCM_RIGHTS`). PROTOCOL.md section 5 is the
//! format.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;

/// The host protocol's version.
pub const HOST_PROTOCOL: u32 = 1;
/// The longest message either side sends.
pub const MAX_MESSAGE: usize = 4096;
/// The longest path a Unix socket address holds (`sun_path` less its NUL).
pub const MAX_PATH: usize = 107;

/// A new `SOCK_SEQPACKET` Unix socket (close-on-exec).
pub fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor only we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The `sockaddr_un` of `path` (at most [`MAX_PATH`] bytes, no NUL).
pub fn sockaddr(path: &Path) -> io::Result<libc::sockaddr_un> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() > MAX_PATH || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not a socket path (at most {MAX_PATH} bytes)",
                path.display()
            ),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok(addr)
}

/// Bind `sock` to `path`.
pub fn bind(sock: &OwnedFd, path: &Path) -> io::Result<()> {
    let addr = sockaddr(path)?;
    // SAFETY: binding our own socket to an address we built.
    let r = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&raw const addr).cast(),
            size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A new socket connected to `path`.
pub fn connect(path: &Path) -> io::Result<OwnedFd> {
    let sock = seqpacket()?;
    let addr = sockaddr(path)?;
    // SAFETY: connecting our socket to an address we built.
    let r = unsafe {
        libc::connect(
            sock.as_raw_fd(),
            (&raw const addr).cast(),
            size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

/// True when `fd` is readable (or closed, or failed) within `wait`.
pub fn readable(fd: RawFd, wait: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one pollfd we own.
    let r = unsafe { libc::poll(&mut p, 1, wait.as_millis().min(60_000) as libc::c_int) };
    r > 0
}

/// Send `msg` as one packet, with `fd` attached when given.
pub fn send(sock: RawFd, msg: &serde_json::Value, fd: Option<RawFd>) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    if body.len() > MAX_MESSAGE {
        return Err(io::Error::other("host message too long"));
    }
    let mut iov = libc::iovec {
        iov_base: body.as_ptr() as *mut libc::c_void,
        iov_len: body.len(),
    };
    // Room for one descriptor's control message, aligned.
    let mut control = [0u64; 4];
    // SAFETY: an all-zero msghdr is valid; its buffers are set below.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;
        m.msg_control = control.as_mut_ptr().cast();
        m.msg_controllen = space;
        // SAFETY: the control buffer holds `space` bytes (32 >= 24), and
        // CMSG_FIRSTHDR points into it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&m);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as usize;
            libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(fd);
        }
    }
    // SAFETY: msghdr points at live buffers of the sizes it says.
    let n = unsafe { libc::sendmsg(sock, &m, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One packet into `buf` and the first descriptor it carried (any more are
/// closed). A packet longer than `buf` (or whose descriptors did not fit)
/// comes back as `buf.len()` bytes: pass a buffer one byte longer than the
/// longest message and treat that length as an error.
pub fn recv(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<File>)> {
    let mut control = [0u64; 16];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; its buffers are set below.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_control = control.as_mut_ptr().cast();
    m.msg_controllen = size_of_val(&control);
    // SAFETY: msghdr points at live buffers of the sizes it says.
    let n = unsafe { libc::recvmsg(sock, &mut m, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut first = None;
    // SAFETY: walking the control messages the kernel wrote into `control`.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(&m) };
    while !c.is_null() {
        // SAFETY: `c` is a header inside `control` (CMSG_FIRSTHDR/NXTHDR).
        let h = unsafe { &*c };
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: as above; the data length is what the header says.
            let data = unsafe { libc::CMSG_DATA(c) };
            let len = h.cmsg_len as usize - (data as usize - c as usize);
            for i in 0..len / size_of::<RawFd>() {
                // SAFETY: the kernel installed these descriptors for us.
                let fd = unsafe { data.cast::<RawFd>().add(i).read_unaligned() };
                // SAFETY: a new descriptor only we own; closed if not kept.
                let f = unsafe { File::from_raw_fd(fd) };
                if first.is_none() {
                    first = Some(f);
                }
            }
        }
        // SAFETY: as above.
        c = unsafe { libc::CMSG_NXTHDR(&m, c) };
    }
    if m.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Ok((buf.len(), first));
    }
    Ok((n as usize, first))
}

/// Who may connect to a host or engine socket: these users and groups (by
/// the peer's credentials); with both empty, this process's own user and
/// group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// Allowed user ids.
    pub uids: Vec<u32>,
    /// Allowed group ids (the peer's primary group).
    pub gids: Vec<u32>,
}

impl Access {
    /// Whether a peer of `uid` and `gid` may connect.
    pub fn allows(&self, uid: u32, gid: u32) -> bool {
        if self.uids.is_empty() && self.gids.is_empty() {
            // SAFETY: getuid and getgid cannot fail.
            let (me, my_group) = unsafe { (libc::getuid(), libc::getgid()) };
            return uid == me || gid == my_group;
        }
        self.uids.contains(&uid) || self.gids.contains(&gid)
    }
}

/// A listening, non-blocking `SOCK_SEQPACKET` socket at `path`, mode 0660:
/// a stale socket file an earlier process left there is replaced; any
/// other file there is an error. (Non-blocking: a client that connects and
/// goes before the accept must not leave an accept loop waiting.)
pub fn listen(path: &Path) -> io::Result<OwnedFd> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            std::fs::remove_file(path)?;
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let fd = seqpacket()?;
    bind(&fd, path)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o660))?;
    // SAFETY: listen and fcntl on our own bound socket, integer arguments.
    unsafe {
        if libc::listen(fd.as_raw_fd(), 64) < 0
            || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) < 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

/// A peer's credentials, as the kernel recorded them at connect.
#[derive(Debug, Clone, Copy)]
pub struct Cred {
    /// The peer's process id.
    pub pid: i32,
    /// Its user id.
    pub uid: u32,
    /// Its primary group id.
    pub gid: u32,
}

/// The credentials of the peer of the connected Unix socket `fd`
/// (`SO_PEERCRED`).
pub fn peer_credentials(fd: RawFd) -> io::Result<Cred> {
    // SAFETY: an all-zero ucred is valid; getsockopt writes at most its size.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: as above, into our own struct.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut c).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Cred {
        pid: c.pid,
        uid: c.uid,
        gid: c.gid,
    })
}

/// A new read-only open of the file behind `file` (for a memfd: its
/// memory), through `/proc/self/fd`: a holder can map it `PROT_READ`
/// only.
pub fn reopen_read_only(file: &File) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_descriptors_cross_and_bounds_hold() {
        assert!(sockaddr(Path::new("/run/engram-rack/donor.sock")).is_ok());
        assert!(sockaddr(Path::new(&format!("/{}", "x".repeat(MAX_PATH)))).is_err());
        let mut pair = [0i32; 2];
        // SAFETY: socketpair into our array.
        let r =
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, pair.as_mut_ptr()) };
        assert_eq!(r, 0);
        // SAFETY: new descriptors only we own.
        let (a, b) = unsafe { (OwnedFd::from_raw_fd(pair[0]), OwnedFd::from_raw_fd(pair[1])) };
        let file = tempfile::tempfile().expect("file");
        send(
            a.as_raw_fd(),
            &serde_json::json!({"hi": 1}),
            Some(file.as_raw_fd()),
        )
        .expect("send");
        send(a.as_raw_fd(), &serde_json::json!({"bye": true}), None).expect("send");
        assert!(readable(b.as_raw_fd(), Duration::from_secs(1)));
        let mut buf = vec![0u8; MAX_MESSAGE + 1];
        let (n, fd) = recv(b.as_raw_fd(), &mut buf).expect("recv");
        assert_eq!(&buf[..n], br#"{"hi":1}"#);
        assert!(fd.is_some());
        let (n, fd) = recv(b.as_raw_fd(), &mut buf).expect("recv");
        assert_eq!(&buf[..n], br#"{"bye":true}"#);
        assert!(fd.is_none());
        // A packet longer than the buffer is reported at its full length.
        let long = serde_json::json!({"x": "y".repeat(100)});
        send(a.as_raw_fd(), &long, None).expect("send");
        let mut small = [0u8; 16];
        assert_eq!(
            recv(b.as_raw_fd(), &mut small).expect("recv").0,
            small.len()
        );
        // Messages over the bound are not sent.
        let huge = serde_json::json!({"x": "y".repeat(MAX_MESSAGE)});
        assert!(send(a.as_raw_fd(), &huge, None).is_err());
        drop(a);
        assert_eq!(recv(b.as_raw_fd(), &mut buf).expect("eof").0, 0);
    }
}

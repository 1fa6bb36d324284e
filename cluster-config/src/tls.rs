//! TLS material shared by both daemons (filled in below).

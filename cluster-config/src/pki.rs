//! The rack PKI (filled in below).

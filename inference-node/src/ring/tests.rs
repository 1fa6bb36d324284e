//! Tests of the ring's memory (serving it needs a node: see
//! `integration-tests/tests/ring.rs`).

use super::*;

fn shape() -> Shape {
    Shape {
        slots: 4,
        layers: 2,
        columns: 3,
        positions: 8,
        first_column: 21,
        layer_ids: [1, 14],
        gpu_deadline_ns: 5_000_000,
        row_bytes: 264,
    }
}

#[test]
fn a_ring_made_here_opens_elsewhere_and_publishes_where_the_layout_says() {
    let ring = RingMemory::create(&shape()).expect("create");
    let other = RingMemory::open(ring.file().try_clone().expect("dup")).expect("open");
    assert_eq!(other.shape(), ring.shape());
    assert_eq!(other.client_state(), client_state::NEVER);
    // Two positions of both sections: section 0's six ids, then section 1's.
    let ids: Vec<i64> = (0..12).collect();
    ring.publish(5, 3, 2, &ids).expect("publish");
    let s = 5 % 4;
    assert_eq!(other.request(s), 5);
    let sh = other.shape();
    let id_at = |l, p, c| {
        let at = sh.slot_at(s) + sh.id_at(l, p, c);
        // SAFETY: inside the mapping.
        unsafe { std::ptr::read_unaligned(other.as_ptr().add(at as usize).cast::<i64>()) }
    };
    assert_eq!(id_at(0, 0, 0), 0);
    assert_eq!(id_at(0, 1, 2), 5);
    assert_eq!(id_at(1, 0, 0), 6);
    assert_eq!(id_at(1, 1, 2), 11);
    // One section only: its ids go to its own place.
    ring.publish(6, 2, 1, &[7, 8, 9]).expect("publish");
    let s6 = 6 % 4;
    let at = sh.slot_at(s6) + sh.id_at(1, 0, 1);
    // SAFETY: inside the mapping.
    let v = unsafe { std::ptr::read_unaligned(other.as_ptr().add(at as usize).cast::<i64>()) };
    assert_eq!(v, 8);
    // Bad publishes are refused, not written.
    assert!(ring.publish(0, 3, 1, &[0; 6]).is_err());
    assert!(ring.publish(7, 4, 1, &[0; 3]).is_err());
    assert!(ring.publish(7, 3, 9, &[0; 54]).is_err());
    assert!(ring.publish(7, 3, 1, &[0; 5]).is_err());
    assert_eq!(other.request(7 % 4), 0);
}

#[test]
fn memory_that_is_not_a_sealed_ring_is_refused() {
    // A memfd whose size is not sealed.
    // SAFETY: a NUL-terminated literal.
    let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: a new descriptor.
    let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.set_len(1 << 20).expect("size");
    let e = RingMemory::open(f.try_clone().expect("dup")).expect_err("unsealed");
    assert!(e.0.contains("sealed"), "{e}");
    // Sealed, but no header.
    // SAFETY: fcntl with integer arguments.
    unsafe {
        libc::fcntl(
            fd,
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
        )
    };
    let e = RingMemory::open(f).expect_err("no header");
    assert!(e.0.contains("magic"), "{e}");
    // A regular file: not sealable at all.
    let t = tempfile::tempfile().expect("tmp");
    t.set_len(1 << 20).expect("size");
    assert!(RingMemory::open(t).is_err());
    // A header whose shape needs more memory than the memfd has.
    let ring = RingMemory::create(&shape()).expect("create");
    let big = Shape {
        positions: 4096,
        ..shape()
    };
    let h = big.encode().expect("encode");
    // SAFETY: the ring's own header page.
    unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), ring.as_ptr(), h.len()) };
    let e = RingMemory::open(ring.file().try_clone().expect("dup")).expect_err("short");
    assert!(e.0.contains("bytes of memory"), "{e}");
}

#[test]
fn the_fault_log_keeps_the_last_32_faults_with_their_step_tags() {
    let ring = RingMemory::create(&shape()).expect("create");
    let other = RingMemory::open(ring.file().try_clone().expect("dup")).expect("open");
    ring.tag(9, 41);
    assert_eq!(other.step_tag(9 % 4), 41);
    assert_eq!(other.fault(1), None, "no fault yet");
    let f = |n: u64| Fault {
        seq: n,
        step: 1000 + n,
        section: (n % 2) as u32,
        status: 2,
    };
    for n in 1..=40 {
        ring.log_fault(f(n));
        assert_eq!(other.fault(n), Some(f(n)));
        assert_eq!(other.faults(), (n, n, (n % 2) as u32, 2));
    }
    // Faults 9 to 40 are in the log; 1 to 8 were overwritten.
    assert_eq!(other.fault(8), None);
    assert_eq!(other.fault(9), Some(f(9)));
    assert_eq!(other.fault(41), None);
    assert_eq!(other.fault(0), None);
}

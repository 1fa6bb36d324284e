//! NUMA placement of a table's memory: `mbind(MPOL_BIND)` on a mapping
//! before any of its pages exists, so that every page the load then writes
//! comes from one node's memory. A host with two sockets runs one donor per
//! socket, each with its tables on its own node (`numa_node` in the
//! config). For a memfd the policy belongs to the file: every process that
//! maps it (the host's engines, through the donor's host socket) sees the
//! same placement in its `numa_maps`.

use std::io;
use std::path::Path;

/// The NUMA nodes this host has online, from sysfs (`[0]` on a host
/// without NUMA).
pub fn online_nodes() -> Vec<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/node/online").unwrap_or_default();
    let mut nodes = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
            // At most the kernel's bound on nodes, whatever sysfs says.
            nodes.extend(a..=b.min(a.saturating_add(1024)));
        }
    }
    if nodes.is_empty() && !Path::new("/sys/devices/system/node").exists() {
        nodes.push(0);
    }
    nodes
}

/// Bind `map`'s pages to NUMA node `node` (`MPOL_BIND`): an error naming
/// the host's nodes when `node` is not one of them.
pub fn bind(map: &[u8], node: u32) -> io::Result<()> {
    let online = online_nodes();
    if !online.contains(&node) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "NUMA node {node} is not online on this host (its nodes: {})",
                online
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let bits = libc::c_ulong::BITS;
    let mut mask = vec![0 as libc::c_ulong; node as usize / bits as usize + 1];
    mask[node as usize / bits as usize] |= 1 << (node % bits);
    // The kernel reads `maxnode - 1` bits of the mask.
    let maxnode = mask.len() as libc::c_ulong * libc::c_ulong::from(bits) + 1;
    const MPOL_BIND: libc::c_int = 2;
    // SAFETY: the range is the caller's mapping; the mask holds the bits
    // `maxnode` says; mbind changes only the placement of future pages.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            map.as_ptr(),
            map.len(),
            MPOL_BIND,
            mask.as_ptr(),
            maxnode,
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("binding table memory to NUMA node {node} (mbind): {e}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_host_has_node_0_and_a_missing_node_is_named() {
        assert!(online_nodes().contains(&0));
        let mut map = memmap2::MmapMut::map_anon(1 << 21).expect("map");
        bind(&map, 0).expect("bind to node 0");
        map[0] = 1;
        let e = bind(&map, 1000).expect_err("node 1000");
        assert!(
            e.to_string().contains("NUMA node 1000 is not online"),
            "{e}"
        );
    }
}

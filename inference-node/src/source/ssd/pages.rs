//! Page-aligned buffers for O_DIRECT reads, and what one page read is
//! (where it is, which row it holds, the checksum it must have).

use std::alloc::Layout;

use engram_protocol::etab::{PAGE_BYTES, page_checksum};

/// One page, in bytes.
pub(crate) const PAGE: usize = PAGE_BYTES as usize;

/// A page-aligned buffer of whole pages (O_DIRECT needs aligned memory).
pub(crate) struct Pages {
    ptr: std::ptr::NonNull<u8>,
    pages: usize,
}

// SAFETY: `Pages` owns its allocation exclusively, like a `Box<[u8]>`.
unsafe impl Send for Pages {}

impl Pages {
    pub(crate) fn new(pages: usize) -> Self {
        let layout = Self::layout(pages);
        // SAFETY: the layout has a non-zero size (at least one page).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, pages }
    }

    fn layout(pages: usize) -> Layout {
        Layout::from_size_align(pages.max(1) * PAGE, PAGE)
            .expect("page multiples are valid layouts")
    }

    /// Pages it holds.
    pub(crate) fn len(&self) -> usize {
        self.pages
    }

    pub(crate) fn page_mut(&mut self, i: usize) -> &mut [u8] {
        assert!(i < self.pages);
        // SAFETY: in bounds of the allocation (checked above), uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(i * PAGE), PAGE) }
    }

    pub(crate) fn page_ptr(&mut self, i: usize) -> *mut u8 {
        self.page_mut(i).as_mut_ptr()
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.pages)) }
    }
}

impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pages({})", self.pages)
    }
}

/// One row's read: the page holding it and what it must contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageRead {
    /// File offset of the page.
    pub offset: u64,
    /// Page index in the table (for messages).
    pub page: u64,
    /// The row's offset inside the page.
    pub in_page: usize,
    /// The row's size (the table's encoding's).
    pub len: usize,
    /// The page's checksum from the file's `page_xxh3` tensor, if it has one.
    pub sum: Option<u64>,
}

/// Why one page read gave no row.
#[derive(Debug)]
pub(crate) enum PageError {
    /// The read failed or came back short.
    Io(std::io::Error),
    /// The page's bytes do not match its checksum: never used.
    Checksum {
        page: u64,
        actual: u64,
        expected: u64,
    },
}

impl std::fmt::Display for PageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "{e}"),
            Self::Checksum {
                page,
                actual,
                expected,
            } => write!(
                f,
                "page {page} hashes to {actual:016x}, its checksum is {expected:016x}: the copy is corrupt on disk"
            ),
        }
    }
}

impl PageRead {
    /// Check a read's result (`n` bytes landed in `page`) and copy the row
    /// into `row` ([`Self::len`] bytes).
    pub(crate) fn take_row(&self, page: &[u8], n: usize, row: &mut [u8]) -> Result<(), PageError> {
        if n < self.in_page + self.len || n > page.len() || row.len() != self.len {
            return Err(PageError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("short read at {}: {n} bytes", self.offset),
            )));
        }
        if let Some(expected) = self.sum {
            // Checksums cover the whole page: a file with them is whole pages.
            let actual = page_checksum(&page[..n]);
            if actual != expected {
                return Err(PageError::Checksum {
                    page: self.page,
                    actual,
                    expected,
                });
            }
        }
        row.copy_from_slice(&page[self.in_page..self.in_page + self.len]);
        Ok(())
    }
}

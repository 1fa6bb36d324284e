//! Row-id lists as people type them: `1,2,3`, ranges `10-20`, or a mix.

/// Parse `1,5,10-20` into row ids, in order, refusing more than `max` ids.
pub fn parse_rows(s: &str, max: usize) -> Result<Vec<u64>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (parse_one(a)?, parse_one(b)?),
            None => {
                let v = parse_one(part)?;
                (v, v)
            }
        };
        if hi < lo {
            return Err(format!("range {part:?} runs backwards"));
        }
        // hi - lo + 1 overflows for 0-u64::MAX: compare without adding.
        if hi - lo >= (max - out.len()) as u64 {
            return Err(format!("more than {max} rows requested"));
        }
        out.extend(lo..=hi);
    }
    if out.is_empty() {
        return Err("no rows given".into());
    }
    Ok(out)
}

fn parse_one(s: &str) -> Result<u64, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a row id"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_ranges() {
        assert_eq!(parse_rows("1,2,3", 10), Ok(vec![1, 2, 3]));
        assert_eq!(parse_rows("5-7, 2", 10), Ok(vec![5, 6, 7, 2]));
        assert!(parse_rows("7-5", 10).is_err());
        assert!(parse_rows("x", 10).is_err());
        assert!(parse_rows("", 10).is_err());
        assert!(parse_rows("0-18446744073709551615", 10).is_err());
        assert!(parse_rows("1-11", 10).is_err());
    }
}
